//! Asynchronous execution: an execute stage that returns before its work is done, and completes
//! the call later, from another thread (XLA's handlers returning `ffi::Future`, on XLA:CPU).
//!
//! A bundle implements [`ExecuteAsync`] instead of [`Execute`](super::bundle::Execute): its
//! `start` gets the state, the context and the attributes, and a [`Pending`] call, which is
//! `Send + 'static`: the handler moves it to a thread or a queue and returns. Whoever holds it
//! then calls [`Pending::complete`] with a closure that gets the call's arguments and results,
//! decoded as the bundle declares them, and returns the outcome; the runtime is told the call
//! is done (or failed) when the closure returns. XLA keeps the buffers alive until then, and
//! waits: under `jit` the program's next step runs after the completion.
//!
//! Why it is safe:
//! - the views exist only inside the completion closure (their lifetime is the closure's), so
//!   none outlives the completion, after which XLA may free the buffers;
//! - XLA reuses the call frame as soon as the handler returns, so `Pending` owns copies of the
//!   argument and result lists (the `XLA_FFI_Buffer`s and their dimensions); the data pointers
//!   are XLA's, valid until the completion;
//! - a `Pending` dropped without being completed (a queue shut down, a panic while it was held)
//!   completes the call with an error, so XLA never waits forever; a panic in the completion
//!   closure is caught and becomes the call's error;
//! - a call is completed exactly once: `complete` and `fail` consume the `Pending`.
//!
//! Cost: each call allocates its `Pending` (the copies of the lists: a few small vectors), unlike
//! a synchronous execute, which allocates nothing; a bundle whose calls are short should stay
//! synchronous.
//!
//! What it cannot see: a `Pending` that is kept forever (leaked, or held by a thread that never
//! runs it) leaves its execution waiting forever.
//!
//! The decoding of arguments and results happens in the completion, so a call whose operands
//! do not fit the signature fails there, with the same messages as a synchronous bundle's.
//! Host bundles only: XLA:CPU runs such handlers; GPU handlers are asynchronous by their
//! stream already.

use std::fmt;
use std::io::Write;
use std::marker::PhantomData;
use std::ptr;

use super::api::Api;
use super::attrs::DecodeAttrs;
use super::buffer::{ArgsView, DecodeArgs, DecodeRets, RetsView};
use super::bundle::{info, Bundle, BundleBuilder, BundleState};
use super::context::Context;
use super::error::{DecodeErrors, FfiError, FfiResult};
use super::panic::catch;
use super::platform::Host;
use super::stage::Stage;
use super::sys;
use super::trampoline::handle;

/// The execute stage of a bundle that completes its calls later (see the module's docs).
pub trait ExecuteAsync: Bundle<Platform = Host> {
    /// The arguments the completion decodes.
    type Args<'a>: DecodeArgs<'a, Host>;
    /// The results the completion decodes.
    type Rets<'a>: DecodeRets<'a, Host>;
    /// The attributes `start` decodes (`()` ignores them).
    type Attrs<'a>: DecodeAttrs<'a>;
    /// Runs in the handler: takes what it needs from the state and attributes and hands `call`
    /// on (to a thread, a pool, a queue), or completes or fails it at once. It returns nothing:
    /// an error is the call's, through [`Pending::fail`]. A panic here is caught; the call then
    /// fails when the `Pending` is dropped (at once if it was not handed on yet).
    fn start(state: &Self::State, ctx: &Context<'_>, attrs: Self::Attrs<'_>, call: Pending<Self>);
}

/// The owned copies of one call's argument and result lists. Each buffer is boxed: the lists
/// point at them while the vector still grows.
#[allow(clippy::vec_box)]
struct Lists {
    args: sys::XLA_FFI_Args,
    rets: sys::XLA_FFI_Rets,
    _buffers: Vec<Box<sys::XLA_FFI_Buffer>>,
    _dims: Vec<Vec<i64>>,
    _types: (Vec<sys::XLA_FFI_ArgType>, Vec<sys::XLA_FFI_RetType>),
    _pointers: (Vec<*mut std::ffi::c_void>, Vec<*mut std::ffi::c_void>),
}

impl Lists {
    /// Copies the frame's lists, each buffer validated first.
    fn copy(args: &sys::XLA_FFI_Args, rets: &sys::XLA_FFI_Rets) -> FfiResult<Lists> {
        let mut buffers = Vec::new();
        let mut dims = Vec::new();
        let mut copy = |size: i64, items: *mut *mut std::ffi::c_void, what: &str| {
            let mut pointers = Vec::with_capacity(size as usize);
            for i in 0..size as usize {
                // SAFETY: XLA's list holds `size` entries (validated by the caller's views).
                let raw = unsafe { *items.add(i) }.cast::<sys::XLA_FFI_Buffer>();
                if raw.is_null() {
                    return Err(FfiError::invalid_argument(format!("{what} {i} is null")));
                }
                // SAFETY: a BUFFER entry points to an XLA_FFI_Buffer valid for the call (the
                // caller's views checked its type and struct size).
                let mut buffer = Box::new(unsafe { raw.read() });
                let rank = buffer.rank.max(0) as usize;
                let shape = if rank == 0 {
                    Vec::new()
                } else {
                    // SAFETY: `rank` dimensions (validated by the caller's views).
                    unsafe { std::slice::from_raw_parts(buffer.dims, rank) }.to_vec()
                };
                dims.push(shape);
                buffer.dims = dims.last_mut().map_or(ptr::null_mut(), |d| d.as_mut_ptr());
                pointers.push((buffer.as_mut() as *mut sys::XLA_FFI_Buffer).cast());
                buffers.push(buffer);
            }
            Ok(pointers)
        };
        let mut arg_pointers = copy(args.size, args.args, "argument")?;
        let mut ret_pointers = copy(rets.size, rets.rets, "result")?;
        let mut arg_types = vec![sys::XLA_FFI_ArgType::BUFFER; arg_pointers.len()];
        let mut ret_types = vec![sys::XLA_FFI_RetType::BUFFER; ret_pointers.len()];
        Ok(Lists {
            args: sys::XLA_FFI_Args {
                struct_size: sys::XLA_FFI_Args::STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                size: args.size,
                types: arg_types.as_mut_ptr(),
                args: arg_pointers.as_mut_ptr(),
            },
            rets: sys::XLA_FFI_Rets {
                struct_size: sys::XLA_FFI_Rets::STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                size: rets.size,
                types: ret_types.as_mut_ptr(),
                rets: ret_pointers.as_mut_ptr(),
            },
            _buffers: buffers,
            _dims: dims,
            _types: (arg_types, ret_types),
            _pointers: (arg_pointers, ret_pointers),
        })
    }
}

/// A call of an [`ExecuteAsync`] bundle, to be completed once, from any thread.
pub struct Pending<B: ExecuteAsync> {
    api: Api<'static>,
    future: *mut sys::XLA_FFI_Future,
    lists: Option<Box<Lists>>,
    _bundle: PhantomData<fn() -> B>,
}

// SAFETY: the runtime lets any thread complete a future; the buffers the lists point to are
// XLA's, alive until the completion, and only viewed inside it; the lists are owned.
unsafe impl<B: ExecuteAsync> Send for Pending<B> {}

impl<B: ExecuteAsync> fmt::Debug for Pending<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pending({})", B::TARGET)
    }
}

impl<B: ExecuteAsync> Pending<B> {
    /// Decodes the call's arguments and results as `B` declares them, runs `work` on them, and
    /// completes the call with its outcome (a panic in `work` is caught and is the call's error).
    pub fn complete(
        mut self,
        work: impl for<'s> FnOnce(B::Args<'s>, B::Rets<'s>) -> FfiResult<()>,
    ) {
        let lists = self
            .lists
            .take()
            .expect("a pending call has its lists until completed");
        let outcome = catch(
            || format!("{} [execute, completion]", B::TARGET),
            || {
                let mut errors = DecodeErrors::new();
                // SAFETY: the lists are copies laid out as XLA's, pointing at buffers XLA keeps
                // alive until this call completes (below, after the views are gone).
                let args = unsafe { ArgsView::<Host>::new(&lists.args) }
                    .map_err(|e| errors.push(e))
                    .ok();
                let decoded_args = args.and_then(|a| B::Args::decode(a, &mut errors));
                let rets = args.and_then(|a| {
                    // SAFETY: as above.
                    unsafe { RetsView::new(&lists.rets, a) }
                        .map(|v| v.hiding(<B::Args<'_> as DecodeArgs<'_, Host>>::hides_data))
                        .map_err(|e| errors.push(e))
                        .ok()
                        .and_then(|v| B::Rets::decode(v, &mut errors))
                });
                errors.into_result("execute, completion")?;
                match (decoded_args, rets) {
                    (Some(a), Some(r)) => work(a, r),
                    _ => Err(FfiError::internal("decoding failed without a message")),
                }
            },
        );
        self.finish(outcome.err());
        drop(lists);
    }

    /// Completes the call with `error` (e.g. a check `start` made).
    pub fn fail(mut self, error: FfiError) {
        self.lists.take();
        self.finish(Some(error));
    }

    /// Tells the runtime; reports a failure to do so on stderr (nowhere else to report it).
    fn finish(&mut self, error: Option<FfiError>) {
        let future = std::mem::replace(&mut self.future, ptr::null_mut());
        if future.is_null() {
            return;
        }
        let message = |e: &FfiError| match e {
            FfiError::Decode { .. } | FfiError::Panic { .. } => format!("{}: {e}", B::TARGET),
            _ => format!("{}: [execute, completion] {e}", B::TARGET),
        };
        // SAFETY: the future is this runtime's, pending, and completed only here (the pointer is
        // taken out of `self` first).
        if let Err(e) = unsafe { self.api.future_complete(future, error.as_ref(), message) } {
            let _ = writeln!(
                std::io::stderr(),
                "xla-ffi-bundles: {}: could not complete an asynchronous call: {e}",
                B::TARGET
            );
        }
    }
}

impl<B: ExecuteAsync> Drop for Pending<B> {
    fn drop(&mut self) {
        if !self.future.is_null() {
            self.lists.take();
            self.finish(Some(FfiError::internal(
                "the call was dropped without being completed (Pending::complete or fail)",
            )));
        }
    }
}

unsafe extern "C" fn execute_async_entry<B: ExecuteAsync>(
    frame: *mut sys::XLA_FFI_CallFrame,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: XLA calls this entry with a call frame (the trampoline validates it).
    unsafe {
        handle(frame, &info::<B>(Stage::Execute), |frame| {
            let attrs = frame.decode_attrs::<B::Attrs<'_>>()?;
            let state = B::State::fetch(frame.context())?;
            // Validate the lists now (a malformed frame is the handler's error, with no future).
            let mut errors = DecodeErrors::new();
            let (args, rets) = frame.raw_lists();
            if let Ok(view) = ArgsView::<Host>::new(args).map_err(|e| errors.push(e)) {
                for i in 0..view.len() {
                    view.get(i).map_err(|e| errors.push(e)).ok();
                }
                // Their layout only: overlaps (and in-place pairs) are the completion's decoding.
                if let Ok(rets) = RetsView::new(rets, view).map_err(|e| errors.push(e)) {
                    for i in 0..rets.len() {
                        rets.validate(i).map_err(|e| errors.push(e)).ok();
                    }
                }
            }
            errors.into_result("execute")?;
            let lists = Lists::copy(args, rets)?;
            let api = frame.context().api();
            let future = api.future_create()?;
            // SAFETY: the table is XLA's, which lives as long as the process.
            let api = Api::from_raw(api.as_ptr())?;
            // From here the call is the future's: the handler returns no error.
            frame.set_future(future);
            let call = Pending::<B> {
                api,
                future,
                lists: Some(Box::new(lists)),
                _bundle: PhantomData,
            };
            let started = catch(
                || format!("{} [execute, start]", B::TARGET),
                || {
                    B::start(state, frame.context(), attrs, call);
                    Ok(())
                },
            );
            if let Err(e) = started {
                // The call was dropped (and failed) during the unwind, or is held elsewhere.
                let _ = writeln!(std::io::stderr(), "xla-ffi-bundles: {}: {e}", B::TARGET);
            }
            Ok(())
        })
    }
}

impl<B: ExecuteAsync> BundleBuilder<B> {
    /// Adds the execute stage of an asynchronous bundle ([`ExecuteAsync`]).
    pub const fn execute_async(mut self) -> Self {
        self.handlers.execute = Some(execute_async_entry::<B>);
        self
    }
}
