//! A fake XLA runtime for unit tests and fuzzing: an `XLA_FFI_Api` table implemented in Rust,
//! an execution context that keeps state like XLA does, and a builder for call frames.
//!
//! It is never a substitute for the real runtime (the Python tests run real jaxlib); it lets the
//! Rust tests build frames that XLA would never send — wrong struct sizes, counts, dtypes,
//! ranks, null pointers — and check that decoding reports them instead of misbehaving.
//!
//! Test-only (feature `fake-runtime` or `cfg(test)`): its safe-looking functions take raw
//! pointers on trust, which is fine for tests and wrong for anything else.

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::ptr;
use std::sync::atomic::{AtomicI64, Ordering};

use once_cell::sync::Lazy;
use parking_lot::Mutex;

use super::dtype::DataType;
use super::error::ErrorCode;
use super::sys::{self, *};
use super::types::StateTypeRegistration;

mod v0_5;
pub use v0_5::{FakeCollectives, FrozenAttrs, Recorded, Request};

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

struct FakeError {
    code: ErrorCode,
    message: CString,
}

unsafe extern "C" fn error_create(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error {
    // SAFETY: the caller passes valid args with a NUL-terminated message.
    let args = unsafe { &*args };
    let message = if args.message.is_null() {
        CString::default()
    } else {
        // SAFETY: as above.
        unsafe { CStr::from_ptr(args.message) }.to_owned()
    };
    Box::into_raw(Box::new(FakeError {
        code: super::error::ErrorCode::from_raw(args.errc),
        message,
    }))
    .cast()
}

/// API 0.5's `XLA_FFI_Error_GetDetails` (0.3's `GetMessage` with the code): like jaxlib 0.12, it
/// writes the code only when the args declare a size past 0.3's.
unsafe extern "C" fn error_get_message(args: *mut XLA_FFI_Error_GetMessage_Args) {
    // SAFETY: the caller passes valid args and an error made by `error_create`.
    let error = unsafe { &*(*args).error.cast::<FakeError>() };
    // SAFETY: as above.
    unsafe { (*args).message = error.message.as_ptr() };
    // SAFETY: valid args (as above).
    let declared = unsafe { (*args).struct_size };
    if declared >= sys::v0_5::XLA_FFI_Error_GetDetails_Args::STRUCT_SIZE {
        let details = args.cast::<sys::v0_5::XLA_FFI_Error_GetDetails_Args>();
        // SAFETY: args that declare the 0.5 size are a whole `GetDetails_Args`.
        unsafe { (*details).errc = error.code.to_raw() };
    }
}

unsafe extern "C" fn error_destroy(args: *mut XLA_FFI_Error_Destroy_Args) {
    // SAFETY: the error was made by `error_create` and is destroyed once.
    drop(unsafe { Box::from_raw((*args).error.cast::<FakeError>()) });
}

/// Takes ownership of an error returned by a handler: `Ok` for null, else code and message.
pub fn take_result(error: *mut XLA_FFI_Error) -> Result<(), (ErrorCode, String)> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: handlers return errors made by this runtime's `error_create`.
    let error = unsafe { Box::from_raw(error.cast::<FakeError>()) };
    Err((error.code, error.message.to_string_lossy().into_owned()))
}

fn make_error(code: ErrorCode, message: &str) -> *mut XLA_FFI_Error {
    let message = CString::new(message).unwrap_or_default();
    let mut args = XLA_FFI_Error_Create_Args {
        struct_size: XLA_FFI_Error_Create_Args::STRUCT_SIZE,
        extension_start: ptr::null_mut(),
        message: message.as_ptr(),
        errc: code.to_raw(),
    };
    // SAFETY: valid args.
    unsafe { error_create(&mut args) }
}

// ---------------------------------------------------------------------------------------------
// Types and state
// ---------------------------------------------------------------------------------------------

static NEXT_TYPE_ID: AtomicI64 = AtomicI64::new(1000);
/// Name -> (type id, type info), like XLA's process-wide type registry.
static TYPES: Lazy<Mutex<HashMap<String, (i64, usize)>>> = Lazy::new(Default::default);

/// The type info registered for `type_id`.
fn type_info(type_id: i64) -> Option<usize> {
    let types = TYPES.lock();
    types
        .values()
        .find(|(id, _)| *id == type_id)
        .map(|(_, info)| *info)
}

/// `XLA_FFI_Type_Register` as XLA implements it (`xla/ffi/type_registry.cc`): with an unset
/// id (0) it assigns a new one and refuses a name that is registered already; with an id set
/// (a second registration through the same cell, e.g. for another platform) it accepts the
/// same name with the same id and refuses it with another. So two libraries cannot share a
/// state type name, and registering one library's type twice is harmless.
unsafe extern "C" fn type_register(args: *mut XLA_FFI_Type_Register_Args) -> *mut XLA_FFI_Error {
    // SAFETY: the caller passes valid args.
    let args = unsafe { &*args };
    // SAFETY: the name span is readable.
    let name = unsafe { std::slice::from_raw_parts(args.name.ptr.cast::<u8>(), args.name.len) };
    let name = String::from_utf8_lossy(name).into_owned();
    // The id is read under the registry's lock, which its writer below holds too: two threads
    // registering the same cell at once (parallel tests) then see one assign the id and the
    // other register again through it, not both an unset id.
    let mut types = TYPES.lock();
    // SAFETY: `type_id` is a valid in-out pointer.
    let requested = unsafe { (*args.type_id).type_id };
    match (types.get(&name).map(|(id, _)| *id), requested) {
        (Some(id), 0) => make_error(
            ErrorCode::Internal,
            &format!("Type name {name} already registered with type id {id}"),
        ),
        (Some(id), requested) if id != requested => make_error(
            ErrorCode::Internal,
            &format!("Type name {name} already registered with type id {id} vs {requested})"),
        ),
        (Some(_), _) => ptr::null_mut(),
        (None, 0) => {
            let id = NEXT_TYPE_ID.fetch_add(1, Ordering::Relaxed);
            // SAFETY: as above.
            unsafe { (*args.type_id).type_id = id };
            types.insert(name, (id, args.type_info as usize));
            ptr::null_mut()
        }
        (None, requested) => {
            types.insert(name, (requested, args.type_info as usize));
            ptr::null_mut()
        }
    }
}

/// Registers a state type with the fake runtime, as `jax.ffi.register_ffi_type` would;
/// returns the type id, or XLA's error (a name registered by another registration).
pub fn register_type(registration: &StateTypeRegistration) -> Result<i64, (ErrorCode, String)> {
    let name = registration.name();
    let mut args = XLA_FFI_Type_Register_Args {
        struct_size: XLA_FFI_Type_Register_Args::STRUCT_SIZE,
        extension_start: ptr::null_mut(),
        name: XLA_FFI_ByteSpan {
            ptr: name.as_ptr().cast(),
            len: name.len(),
        },
        type_id: registration.type_id_ptr(),
        type_info: registration.type_info_ptr(),
    };
    // SAFETY: valid args pointing to static data.
    take_result(unsafe { type_register(&mut args) })?;
    Ok(registration.type_id())
}

/// Registers the state type of every stateful bundle in `defs` (each once is enough; again is
/// harmless, as with XLA, since the registration's cell holds the id by then).
pub fn register_bundle_types(defs: &[super::BundleDef]) {
    for def in defs {
        for registration in def.types() {
            if let Err((_, message)) = register_type(registration) {
                panic!("registering `{}`: {message}", registration.name());
            }
        }
    }
}

/// Runs `def`'s instantiate stage in `ctx` with `attrs` and no operands, as XLA does once per
/// call site; the state it makes stays in `ctx`.
pub fn instantiate(
    ctx: &FakeContext,
    def: &super::BundleDef,
    attrs: Vec<(&str, OwnedAttr)>,
) -> Result<(), (ErrorCode, String)> {
    let handler = def
        .handler(super::Stage::Instantiate)
        .expect("the bundle has an instantiate stage");
    let mut builder = FrameBuilder::new(super::Stage::Instantiate);
    for (name, value) in attrs {
        builder = builder.attr(name, value);
    }
    builder.build(ctx).call(handler)
}

/// An execution context: states per stage, device facts, and outstanding device memory.
pub struct FakeContext {
    /// The state of each stage that has one, by the stage's C value: (type id, pointer). As on
    /// XLA:GPU, the instantiate state lives as long as the context (the executable), the
    /// prepare and initialize states until [`FakeContext::end_execution`].
    states: Mutex<HashMap<i32, (i64, usize)>>,
    /// User data by type id, as PjRt's `ExecuteOptions::context` holds it.
    user_data: Mutex<HashMap<i64, UserDataEntry>>,
    /// The thread count `XLA_FFI_ThreadPool_NumThreads` reports.
    pub num_threads: i64,
    /// The ordinal `XLA_FFI_DeviceOrdinal_Get` reports.
    pub device_ordinal: i32,
    /// The id `XLA_FFI_RunId_Get` reports.
    pub run_id: i64,
    /// `None`: the platform has no stream (CPU), and Stream_Get fails.
    pub stream: Option<usize>,
    /// Run scheduled tasks on the calling thread instead of a new thread.
    pub inline_tasks: bool,
    allocations: Mutex<HashMap<usize, Vec<u64>>>,
    /// The collectives extension attached to calls ([`FakeContext::attach_collectives`]).
    collectives: Option<FakeCollectives>,
    /// The custom options of calls ([`FakeContext::set_custom_options`]); none: empty.
    custom_options: Option<FrozenAttrs>,
}

/// One user datum: its pointer and the function that drops it.
type UserDataEntry = (usize, unsafe fn(usize));

impl Default for FakeContext {
    fn default() -> Self {
        FakeContext {
            states: Mutex::default(),
            user_data: Mutex::default(),
            num_threads: 4,
            device_ordinal: 0,
            run_id: 42,
            stream: None,
            inline_tasks: false,
            allocations: Mutex::default(),
            collectives: None,
            custom_options: None,
        }
    }
}

impl FakeContext {
    /// A context with the defaults: 4 threads, device 0, run id 42, no stream, tasks on new
    /// threads.
    pub fn new() -> Self {
        Self::default()
    }

    /// A context whose thread pool reports `num_threads` threads.
    pub fn with_threads(num_threads: i64) -> Self {
        let mut ctx = Self::default();
        ctx.num_threads = num_threads;
        ctx
    }

    pub(crate) fn as_raw(&self) -> *mut XLA_FFI_ExecutionContext {
        (self as *const FakeContext).cast_mut().cast()
    }

    /// Device memory allocated and not yet freed.
    pub fn outstanding_allocations(&self) -> usize {
        self.allocations.lock().len()
    }

    /// Number of states held.
    pub fn state_count(&self) -> usize {
        self.states.lock().len()
    }

    /// The state the instantiate stage set, if it is a `T`: what this call site's executions
    /// see (tests read it here rather than guess it from the process-wide registry, which
    /// other tests running in parallel also fill).
    pub fn state<T: super::StateType>(&self) -> Option<&T> {
        let (type_id, state) = *self
            .states
            .lock()
            .get(&super::Stage::Instantiate.to_raw().0)?;
        // SAFETY: `state_set` stored this pointer with `type_id`, which is `T`'s, so it is the
        // `Box<T>` the instantiate stage handed over; it lives until this context is dropped,
        // which the returned borrow of `self` outlives not.
        (type_id != 0 && type_id == T::registration().type_id())
            .then(|| unsafe { &*(state as *const T) })
    }
}

impl FakeContext {
    /// Ends one execution as XLA:GPU does when `ExecuteThunks` returns: the prepare- and
    /// initialize-stage states are deleted with their type's deleter; the instantiate state
    /// stays for the next execution.
    pub fn end_execution(&self) {
        let stages = [super::Stage::Prepare, super::Stage::Initialize].map(|s| s.to_raw().0);
        let ended: Vec<(i64, usize)> = {
            let mut states = self.states.lock();
            stages.iter().filter_map(|s| states.remove(s)).collect()
        };
        delete_states(ended);
    }

    /// The user data of type `T` attached with [`FakeContext::set_user_data`], if any.
    pub fn user_data<T: super::StateType>(&self) -> Option<&T> {
        let type_id = T::registration().type_id();
        let (data, _) = *self.user_data.lock().get(&type_id)?;
        // SAFETY: `set_user_data` stored a `Box<T>` under `T`'s type id; it lives until this
        // context drops, which the returned borrow of `self` does not outlive.
        (type_id != 0).then(|| unsafe { &*(data as *const T) })
    }

    /// Attaches `value` to the executions of this context as user data of type `T`
    /// (`T`'s type must be registered), as a PjRt embedder does through
    /// `ExecuteOptions::context`; dropped with the context.
    pub fn set_user_data<T: super::StateType>(&self, value: T) {
        let type_id = T::registration().type_id();
        assert_ne!(type_id, 0, "register `{}` first", T::registration().name());
        /// Drops the `Box<T>` behind `data`.
        ///
        /// # Safety
        /// `data` must be a `Box<T>` leaked by `set_user_data`, dropped once.
        unsafe fn drop_box<T>(data: usize) {
            // SAFETY: per the contract.
            drop(unsafe { Box::from_raw(data as *mut T) });
        }
        let data = Box::into_raw(Box::new(value)) as usize;
        if let Some((old, drop_old)) = self.user_data.lock().insert(type_id, (data, drop_box::<T>))
        {
            // SAFETY: the replaced entry was inserted the same way and is now unreachable.
            unsafe { drop_old(old) };
        }
    }
}

/// Deletes states with their type's deleter, as XLA does when their owner goes.
fn delete_states(states: Vec<(i64, usize)>) {
    for (type_id, state) in states {
        if let Some(info) = type_info(type_id) {
            // SAFETY: registered type infos point to static `XLA_FFI_TypeInfo`s.
            let info = unsafe { &*(info as *const XLA_FFI_TypeInfo) };
            if let Some(deleter) = info.deleter {
                // SAFETY: `state` was set with this type id and is deleted once.
                unsafe { deleter(state as *mut c_void) };
            }
        }
    }
}

impl Drop for FakeContext {
    /// Deletes the states with their type's deleter, as XLA does when an executable dies, and
    /// the user data.
    fn drop(&mut self) {
        let states: Vec<(i64, usize)> = self.states.lock().drain().map(|(_, v)| v).collect();
        delete_states(states);
        for (_, (data, drop_data)) in self.user_data.lock().drain() {
            // SAFETY: each entry was inserted by `set_user_data` and is dropped once.
            unsafe { drop_data(data) };
        }
    }
}

/// Whether XLA keeps a state for the stage `raw`: the instantiate, prepare and initialize
/// stages. For any other (the execute stage) XLA:GPU's `State_Set`/`Get` dereference a null
/// pointer; the fake says so loudly instead, so a test sees the wrapper let one through.
fn keeps_state(raw: i32) -> Result<(), *mut XLA_FFI_Error> {
    let kept = [
        super::Stage::Instantiate,
        super::Stage::Prepare,
        super::Stage::Initialize,
    ];
    if kept.iter().any(|s| s.to_raw().0 == raw) {
        Ok(())
    } else {
        Err(make_error(
            ErrorCode::Internal,
            "the fake runtime: a state for a stage XLA keeps none for (XLA would dereference \
             a null pointer here)",
        ))
    }
}

/// # Safety
/// `ctx` must be a `FakeContext` made by this module.
unsafe fn fake_ctx<'a>(ctx: *mut XLA_FFI_ExecutionContext) -> Option<&'a FakeContext> {
    // SAFETY: per the contract.
    unsafe { ctx.cast::<FakeContext>().as_ref() }
}

unsafe extern "C" fn state_set(args: *mut XLA_FFI_State_Set_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid args from the FFI layer; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&*args, fake_ctx((*args).ctx)) };
    let Some(ctx) = ctx else {
        return make_error(ErrorCode::Internal, "no context");
    };
    // SAFETY: `type_id` is a valid pointer.
    let type_id = unsafe { (*args.type_id).type_id };
    if type_info(type_id).is_none() {
        return make_error(ErrorCode::InvalidArgument, "type id not registered");
    }
    if let Err(e) = keeps_state(args.stage.0) {
        return e;
    }
    let mut states = ctx.states.lock();
    if let Some((set, _)) = states.get(&args.stage.0) {
        // XLA's words (execution_state.cc).
        return make_error(
            ErrorCode::FailedPrecondition,
            &format!("State is already set with a type id {set}"),
        );
    }
    states.insert(args.stage.0, (type_id, args.state as usize));
    ptr::null_mut()
}

unsafe extern "C" fn state_get(args: *mut XLA_FFI_State_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid args from the FFI layer; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&mut *args, fake_ctx((*args).ctx)) };
    let Some(ctx) = ctx else {
        return make_error(ErrorCode::Internal, "no context");
    };
    // SAFETY: `type_id` is a valid pointer.
    let type_id = unsafe { (*args.type_id).type_id };
    if let Err(e) = keeps_state(args.stage.0) {
        return e;
    }
    match ctx.states.lock().get(&args.stage.0) {
        None => make_error(ErrorCode::NotFound, "State is not set"),
        Some((t, _)) if *t != type_id => {
            make_error(ErrorCode::InvalidArgument, "state type mismatch")
        }
        Some((_, state)) => {
            args.state = *state as *mut c_void;
            ptr::null_mut()
        }
    }
}

unsafe extern "C" fn stream_get(args: *mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid args; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&mut *args, fake_ctx((*args).ctx)) };
    match ctx.and_then(|c| c.stream) {
        Some(stream) => {
            args.stream = stream as *mut c_void;
            ptr::null_mut()
        }
        None => make_error(ErrorCode::Unimplemented, "no stream on this platform"),
    }
}

unsafe extern "C" fn device_ordinal_get(
    args: *mut XLA_FFI_DeviceOrdinal_Get_Args,
) -> *mut XLA_FFI_Error {
    // SAFETY: valid args; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&mut *args, fake_ctx((*args).ctx)) };
    args.device_ordinal = ctx.map_or(-1, |c| c.device_ordinal);
    ptr::null_mut()
}

unsafe extern "C" fn run_id_get(args: *mut XLA_FFI_RunId_Get_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid args; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&mut *args, fake_ctx((*args).ctx)) };
    args.run_id = ctx.map_or(0, |c| c.run_id);
    ptr::null_mut()
}

unsafe extern "C" fn num_threads(
    args: *mut XLA_FFI_ThreadPool_NumThreads_Args,
) -> *mut XLA_FFI_Error {
    // SAFETY: valid args; `ctx` is a FakeContext; `num_threads` is writable.
    unsafe {
        let ctx = fake_ctx((*args).ctx);
        *(*args).num_threads = ctx.map_or(0, |c| c.num_threads);
    }
    ptr::null_mut()
}

struct SendPtr(*mut c_void);
// SAFETY: the task contract says `data` may be used from any thread.
unsafe impl Send for SendPtr {}

unsafe extern "C" fn schedule(args: *mut XLA_FFI_ThreadPool_Schedule_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid args; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&*args, fake_ctx((*args).ctx)) };
    let Some(task) = args.task else {
        return make_error(ErrorCode::InvalidArgument, "null task");
    };
    let data = SendPtr(args.data);
    if ctx.is_some_and(|c| c.inline_tasks) {
        // SAFETY: the caller vouches that the task may run now.
        unsafe { task(data.0) };
    } else {
        std::thread::spawn(move || {
            let data = data;
            // SAFETY: the caller vouches that the task may run on any thread.
            unsafe { task(data.0) }
        });
    }
    ptr::null_mut()
}

unsafe extern "C" fn allocate(args: *mut XLA_FFI_DeviceMemory_Allocate_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid args; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&mut *args, fake_ctx((*args).ctx)) };
    let Some(ctx) = ctx else {
        return make_error(ErrorCode::Internal, "no context");
    };
    if args.alignment > 8 {
        return make_error(
            ErrorCode::InvalidArgument,
            "fake allocator aligns to 8 bytes at most",
        );
    }
    let memory = vec![0u64; args.size.div_ceil(8).max(1)];
    args.data = memory.as_ptr() as *mut c_void;
    ctx.allocations.lock().insert(args.data as usize, memory);
    ptr::null_mut()
}

unsafe extern "C" fn free(args: *mut XLA_FFI_DeviceMemory_Free_Args) -> *mut XLA_FFI_Error {
    // SAFETY: valid args; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&*args, fake_ctx((*args).ctx)) };
    match ctx.and_then(|c| c.allocations.lock().remove(&(args.data as usize))) {
        Some(_) => ptr::null_mut(),
        None => make_error(ErrorCode::InvalidArgument, "free of unknown memory"),
    }
}

/// A future of the fake runtime: the outcome, set once, and a condition to wait on.
struct FakeFuture {
    outcome: parking_lot::Mutex<Option<Result<(), (ErrorCode, String)>>>,
    done: parking_lot::Condvar,
}

unsafe extern "C" fn future_create(args: *mut XLA_FFI_Future_Create_Args) -> *mut XLA_FFI_Error {
    let future = std::sync::Arc::new(FakeFuture {
        outcome: parking_lot::Mutex::new(None),
        done: parking_lot::Condvar::new(),
    });
    // SAFETY: valid args. The runtime's reference, taken back by the frame that waits on it
    // (`BuiltFrame::call`); a completion holds one of its own while it runs.
    unsafe { (*args).future = std::sync::Arc::into_raw(future).cast_mut().cast() };
    ptr::null_mut()
}

/// Completes a fake future; a second completion is an error, as it is a bug.
fn complete_future(
    future: *mut XLA_FFI_Future,
    outcome: Result<(), (ErrorCode, String)>,
) -> *mut XLA_FFI_Error {
    if future.is_null() {
        return make_error(ErrorCode::InvalidArgument, "null future");
    }
    let raw = future.cast::<FakeFuture>().cast_const();
    // SAFETY: made by `future_create`; the waiting frame's reference lives until the outcome is
    // set (below), so the count is at least 1 here. This completion takes one of its own, so
    // that the waiter may drop its reference as soon as it wakes.
    let future = unsafe {
        std::sync::Arc::increment_strong_count(raw);
        std::sync::Arc::from_raw(raw)
    };
    let mut slot = future.outcome.lock();
    if slot.is_some() {
        return make_error(ErrorCode::FailedPrecondition, "future completed twice");
    }
    *slot = Some(outcome);
    future.done.notify_all();
    ptr::null_mut()
}

unsafe extern "C" fn future_set_available(
    args: *mut XLA_FFI_Future_SetAvailable_Args,
) -> *mut XLA_FFI_Error {
    // SAFETY: valid args.
    complete_future(unsafe { (*args).future }, Ok(()))
}

unsafe extern "C" fn future_set_error(
    args: *mut XLA_FFI_Future_SetError_Args,
) -> *mut XLA_FFI_Error {
    // SAFETY: valid args; the runtime takes ownership of the error, as XLA's does.
    let error = take_result(unsafe { (*args).error });
    match error {
        Err(e) => complete_future(unsafe { (*args).future }, Err(e)),
        Ok(()) => make_error(ErrorCode::InvalidArgument, "Error must not be null or OK"),
    }
}

unsafe extern "C" fn user_data_get(
    args: *mut XLA_FFI_ExecutionContext_Get_Args,
) -> *mut XLA_FFI_Error {
    // SAFETY: valid args from the FFI layer; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&mut *args, fake_ctx((*args).ctx)) };
    let Some(ctx) = ctx else {
        return make_error(ErrorCode::Internal, "no context");
    };
    // SAFETY: `type_id` is a valid pointer.
    let type_id = unsafe { (*args.type_id).type_id };
    match ctx.user_data.lock().get(&type_id) {
        // XLA's words (execution_context.cc).
        None => make_error(
            ErrorCode::NotFound,
            &format!("User data with type id {type_id} not found in execution context"),
        ),
        Some((data, _)) => {
            args.data = *data as *mut c_void;
            ptr::null_mut()
        }
    }
}

unsafe extern "C" fn unsupported_register(
    _args: *mut XLA_FFI_Handler_Register_Args,
) -> *mut XLA_FFI_Error {
    make_error(
        ErrorCode::Unimplemented,
        "the fake runtime does not register handlers",
    )
}

struct SyncApi(sys::v0_5::XLA_FFI_Api);
// SAFETY: the table is immutable after construction.
unsafe impl Sync for SyncApi {}
// SAFETY: as above.
unsafe impl Send for SyncApi {}

/// The table of an API 0.5 runtime.
fn build_api() -> sys::v0_5::XLA_FFI_Api {
    v0_5::grow(XLA_FFI_Api {
        struct_size: XLA_FFI_Api::STRUCT_SIZE,
        extension_start: ptr::null_mut(),
        api_version: XLA_FFI_Api_Version {
            struct_size: XLA_FFI_Api_Version::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            major_version: XLA_FFI_API_MAJOR,
            minor_version: XLA_FFI_API_MINOR,
        },
        internal_api: ptr::null(),
        XLA_FFI_Error_Create: Some(error_create),
        XLA_FFI_Error_GetMessage: Some(error_get_message),
        XLA_FFI_Error_Destroy: Some(error_destroy),
        XLA_FFI_Handler_Register: Some(unsupported_register),
        XLA_FFI_Stream_Get: Some(stream_get),
        XLA_FFI_Type_Register: Some(type_register),
        XLA_FFI_ExecutionContext_Get: Some(user_data_get),
        XLA_FFI_State_Set: Some(state_set),
        XLA_FFI_State_Get: Some(state_get),
        XLA_FFI_DeviceMemory_Allocate: Some(allocate),
        XLA_FFI_DeviceMemory_Free: Some(free),
        XLA_FFI_ThreadPool_Schedule: Some(schedule),
        XLA_FFI_ThreadPool_NumThreads: Some(num_threads),
        XLA_FFI_Future_Create: Some(future_create),
        XLA_FFI_Future_SetAvailable: Some(future_set_available),
        XLA_FFI_Future_SetError: Some(future_set_error),
        XLA_FFI_RunId_Get: Some(run_id_get),
        XLA_FFI_DeviceOrdinal_Get: Some(device_ordinal_get),
    })
}

static API: Lazy<SyncApi> = Lazy::new(|| SyncApi(build_api()));

/// The fake API table: an API 0.5 runtime's.
pub fn api() -> *const XLA_FFI_Api {
    ptr::addr_of!(API.0).cast()
}

/// Tables that declare fewer bytes than the mirror, one per size, made on first use.
static SMALL_APIS: Lazy<Mutex<HashMap<(usize, i32), &'static SyncApi>>> =
    Lazy::new(Default::default);

/// A copy of the table that declares `struct_size` bytes: an older runtime, whose version says
/// 0.3 where the size is 0.3's or less (or a newer one that declares more than this mirror has:
/// the crate reads only the fields it mirrors).
///
/// A runtime's table lives as long as the process, and the trampoline relies on that (it
/// remembers the last table it saw, for frames that come without one), so these tables are
/// never freed either: each size is made once and kept here, where it stays reachable.
pub fn api_with_size(struct_size: usize) -> *const XLA_FFI_Api {
    let minor = if struct_size < sys::v0_5::XLA_FFI_Api::STRUCT_SIZE {
        XLA_FFI_API_MINOR
    } else {
        sys::v0_5::XLA_FFI_API_MINOR
    };
    api_with_version(struct_size, minor)
}

/// A copy of the table that declares `struct_size` bytes and API version 0.`minor`, e.g. a table
/// whose size and version disagree.
pub fn api_with_version(struct_size: usize, minor: i32) -> *const XLA_FFI_Api {
    let mut tables = SMALL_APIS.lock();
    let table = tables.entry((struct_size, minor)).or_insert_with(|| {
        let mut table = build_api();
        table.v0_3.struct_size = struct_size;
        table.v0_3.api_version.minor_version = minor;
        Box::leak(Box::new(SyncApi(table)))
    });
    ptr::addr_of!(table.0).cast()
}

/// The table of an API 0.3 runtime (jaxlib 0.10): 0.3's size and version.
pub fn api_v0_3() -> *const XLA_FFI_Api {
    api_with_size(XLA_FFI_Api::STRUCT_SIZE)
}

// ---------------------------------------------------------------------------------------------
// Call frames
// ---------------------------------------------------------------------------------------------

/// A buffer owned by a test: 8-byte aligned data, dims and dtype.
#[derive(Debug, Clone)]
pub struct OwnedBuffer {
    /// The dtype, as its C value.
    pub dtype: XLA_FFI_DataType,
    /// The dimensions.
    pub dims: Vec<i64>,
    /// The data, in 8-byte words so that it is 8-byte aligned.
    pub data: Vec<u64>,
    /// Bytes of valid data in `data`.
    pub bytes: usize,
}

impl OwnedBuffer {
    /// A buffer holding `values` with shape `dims`.
    pub fn from_values<T: super::NativeType>(dims: &[i64], values: &[T]) -> Self {
        let bytes = std::mem::size_of_val(values);
        let mut data = vec![0u64; bytes.div_ceil(8)];
        // SAFETY: `data` has at least `bytes` bytes; `values` is plain data.
        unsafe {
            ptr::copy_nonoverlapping(
                values.as_ptr().cast::<u8>(),
                data.as_mut_ptr().cast::<u8>(),
                bytes,
            )
        };
        OwnedBuffer {
            dtype: T::DTYPE.to_raw(),
            dims: dims.to_vec(),
            data,
            bytes,
        }
    }

    /// A zeroed buffer of `dtype` and `dims` (for results).
    pub fn zeros(dtype: DataType, dims: &[i64]) -> Self {
        let count: usize = dims.iter().map(|&d| d.max(0) as usize).product();
        let bytes = dtype.bytes_for(count).unwrap_or(0);
        OwnedBuffer {
            dtype: dtype.to_raw(),
            dims: dims.to_vec(),
            data: vec![0u64; bytes.div_ceil(8)],
            bytes,
        }
    }

    /// The contents as `T`s.
    pub fn values<T: super::NativeType>(&self) -> Vec<T> {
        let n = self.bytes / std::mem::size_of::<T>();
        // SAFETY: `data` holds at least `bytes` bytes, aligned to 8; `T` is plain data.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr().cast::<T>(), n) }.to_vec()
    }
}

/// An attribute value owned by a test.
#[derive(Debug, Clone)]
pub enum OwnedAttr {
    /// A scalar: dtype and its bytes.
    Scalar(XLA_FFI_DataType, Vec<u8>),
    /// A dense array: dtype, element count, bytes.
    Array(XLA_FFI_DataType, usize, Vec<u8>),
    /// A string: its bytes.
    String(Vec<u8>),
    /// A dictionary: named values.
    Dict(Vec<(String, OwnedAttr)>),
}

impl OwnedAttr {
    /// A scalar of `T`'s dtype.
    pub fn scalar<T: super::NativeType>(value: T) -> Self {
        OwnedAttr::Scalar(T::DTYPE.to_raw(), bytes_of(std::slice::from_ref(&value)))
    }
    /// A PRED scalar.
    pub fn pred(value: bool) -> Self {
        OwnedAttr::Scalar(XLA_FFI_DataType::PRED, vec![value as u8])
    }
    /// A dense array of `T`'s dtype.
    pub fn array<T: super::NativeType>(values: &[T]) -> Self {
        OwnedAttr::Array(T::DTYPE.to_raw(), values.len(), bytes_of(values))
    }
    /// A string.
    pub fn string(value: &str) -> Self {
        OwnedAttr::String(value.as_bytes().to_vec())
    }
}

fn bytes_of<T: Copy>(values: &[T]) -> Vec<u8> {
    // SAFETY: reading the bytes of plain data.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
    .to_vec()
}

fn aligned(bytes: &[u8]) -> Vec<u64> {
    let mut data = vec![0u64; bytes.len().div_ceil(8).max(1)];
    // SAFETY: `data` has room for `bytes`.
    unsafe {
        ptr::copy_nonoverlapping(bytes.as_ptr(), data.as_mut_ptr().cast::<u8>(), bytes.len())
    };
    data
}

enum AttrStorage {
    Scalar(XLA_FFI_Scalar, Vec<u64>),
    Array(XLA_FFI_Array, Vec<u64>),
    String(XLA_FFI_ByteSpan, Vec<u8>),
    Dict(BuiltAttrs),
}

/// An attribute list with stable addresses. Entries are boxed so that pointers into them stay
/// valid while the vectors grow.
#[allow(clippy::vec_box)]
pub struct BuiltAttrs {
    /// The list header, pointing into the vectors below; a frame copies the top-level one.
    pub raw: Box<XLA_FFI_Attrs>,
    /// The type of each attribute, in list (name) order.
    pub types: Vec<XLA_FFI_AttrType>,
    _names: Vec<Box<(XLA_FFI_ByteSpan, Vec<u8>)>>,
    /// The pointers to each attribute's name.
    pub name_ptrs: Vec<*mut XLA_FFI_ByteSpan>,
    _values: Vec<Box<AttrStorage>>,
    /// The pointers to each attribute's value (a scalar, array, byte span or nested list).
    pub value_ptrs: Vec<*mut c_void>,
}

impl BuiltAttrs {
    /// Lays out `attrs` as XLA does: sorted by name.
    pub fn new(attrs: &[(String, OwnedAttr)]) -> Self {
        let mut sorted: Vec<&(String, OwnedAttr)> = attrs.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        let mut names = Vec::new();
        let mut name_ptrs = Vec::new();
        let mut types = Vec::new();
        let mut values = Vec::new();
        let mut value_ptrs = Vec::new();
        for (name, value) in sorted {
            let bytes = name.as_bytes().to_vec();
            let mut entry = Box::new((
                XLA_FFI_ByteSpan {
                    ptr: ptr::null(),
                    len: bytes.len(),
                },
                bytes,
            ));
            entry.0.ptr = entry.1.as_ptr().cast();
            name_ptrs.push(&mut entry.0 as *mut XLA_FFI_ByteSpan);
            names.push(entry);
            let (ty, mut storage) = match value {
                OwnedAttr::Scalar(dtype, bytes) => (
                    XLA_FFI_AttrType::SCALAR,
                    Box::new(AttrStorage::Scalar(
                        XLA_FFI_Scalar {
                            dtype: *dtype,
                            value: ptr::null_mut(),
                        },
                        aligned(bytes),
                    )),
                ),
                OwnedAttr::Array(dtype, len, bytes) => (
                    XLA_FFI_AttrType::ARRAY,
                    Box::new(AttrStorage::Array(
                        XLA_FFI_Array {
                            dtype: *dtype,
                            size: *len,
                            data: ptr::null_mut(),
                        },
                        aligned(bytes),
                    )),
                ),
                OwnedAttr::String(bytes) => (
                    XLA_FFI_AttrType::STRING,
                    Box::new(AttrStorage::String(
                        XLA_FFI_ByteSpan {
                            ptr: ptr::null(),
                            len: bytes.len(),
                        },
                        bytes.clone(),
                    )),
                ),
                OwnedAttr::Dict(entries) => (
                    XLA_FFI_AttrType::DICTIONARY,
                    Box::new(AttrStorage::Dict(BuiltAttrs::new(entries))),
                ),
            };
            let pointer: *mut c_void = match storage.as_mut() {
                AttrStorage::Scalar(raw, data) => {
                    raw.value = data.as_mut_ptr().cast();
                    (raw as *mut XLA_FFI_Scalar).cast()
                }
                AttrStorage::Array(raw, data) => {
                    raw.data = data.as_mut_ptr().cast();
                    (raw as *mut XLA_FFI_Array).cast()
                }
                AttrStorage::String(raw, data) => {
                    raw.ptr = data.as_ptr().cast();
                    (raw as *mut XLA_FFI_ByteSpan).cast()
                }
                AttrStorage::Dict(built) => (built.raw.as_mut() as *mut XLA_FFI_Attrs).cast(),
            };
            types.push(ty);
            values.push(storage);
            value_ptrs.push(pointer);
        }
        let mut built = BuiltAttrs {
            raw: Box::new(XLA_FFI_Attrs {
                struct_size: XLA_FFI_Attrs::STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                size: types.len() as i64,
                types: ptr::null_mut(),
                names: ptr::null_mut(),
                attrs: ptr::null_mut(),
            }),
            types,
            _names: names,
            name_ptrs,
            _values: values,
            value_ptrs,
        };
        built.raw.types = built.types.as_mut_ptr();
        built.raw.names = built.name_ptrs.as_mut_ptr();
        built.raw.attrs = built.value_ptrs.as_mut_ptr();
        built
    }
}

/// Buffers laid out as an argument or result list.
pub struct BuiltBuffers {
    /// The buffers' data and dims.
    pub owned: Vec<OwnedBuffer>,
    /// One `XLA_FFI_Buffer` per buffer, pointing into `owned` (or at a device address).
    pub raw: Vec<Box<XLA_FFI_Buffer>>,
    /// The type of each entry (1: a buffer).
    pub types: Vec<i32>,
    /// The pointers to the `XLA_FFI_Buffer`s in `raw`: the list the frame points to.
    pub ptrs: Vec<*mut c_void>,
}

impl BuiltBuffers {
    /// `devices[i]`: the address buffer `i` points at instead of its own data (device memory).
    fn new(mut owned: Vec<OwnedBuffer>, devices: &[Option<usize>]) -> Self {
        let mut raw = Vec::new();
        let mut ptrs = Vec::new();
        for (i, b) in owned.iter_mut().enumerate() {
            let data = match devices.get(i).copied().flatten() {
                Some(address) => address as *mut c_void,
                None => b.data.as_mut_ptr().cast(),
            };
            let mut buffer = Box::new(XLA_FFI_Buffer {
                struct_size: XLA_FFI_Buffer::STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                dtype: b.dtype,
                data,
                rank: b.dims.len() as i64,
                dims: b.dims.as_mut_ptr(),
            });
            ptrs.push((buffer.as_mut() as *mut XLA_FFI_Buffer).cast());
            raw.push(buffer);
        }
        let types = vec![1; owned.len()];
        BuiltBuffers {
            owned,
            raw,
            types,
            ptrs,
        }
    }
}

/// A complete call frame with all its storage. Tests may edit `frame` and the raw parts
/// before calling, to present malformed input.
pub struct BuiltFrame {
    /// The call frame handlers are called with.
    pub frame: Box<XLA_FFI_CallFrame>,
    /// The arguments.
    pub args: BuiltBuffers,
    /// The results, which the handler writes (see [`BuiltFrame::result`]).
    pub rets: BuiltBuffers,
    /// The attributes (the frame holds a copy of their list header).
    pub attrs: BuiltAttrs,
    /// The metadata extension and the metadata it points to, for [`FrameBuilder::metadata`]
    /// frames.
    pub metadata: Option<Box<(XLA_FFI_Metadata_Extension, XLA_FFI_Metadata)>>,
    /// For each result, the argument whose buffer it is ([`FrameBuilder::ret_in_place_of`]).
    ret_aliases: Vec<Option<usize>>,
}

impl BuiltFrame {
    /// Calls `handler` with this frame; if the handler returned a future (an asynchronous
    /// call), waits for it as XLA does and gives its outcome.
    pub fn call(&mut self, handler: XLA_FFI_Handler) -> Result<(), (ErrorCode, String)> {
        self.frame.future = ptr::null_mut();
        // SAFETY: the frame and all it points to are alive and laid out as XLA does (or as
        // deliberately broken by the test, which the handler must survive).
        let result = take_result(unsafe { handler(self.frame.as_mut()) });
        let future = std::mem::replace(&mut self.frame.future, ptr::null_mut());
        if future.is_null() {
            return result;
        }
        assert!(
            result.is_ok(),
            "a handler returned both an error and a future: {result:?}"
        );
        // SAFETY: made by `future_create`: the runtime's reference, taken back once.
        let future = unsafe { std::sync::Arc::from_raw(future.cast::<FakeFuture>().cast_const()) };
        let mut slot = future.outcome.lock();
        while slot.is_none() {
            future.done.wait(&mut slot);
        }
        slot.take().expect("completed")
    }

    /// The `index`th result after the call (an in-place result's argument buffer).
    pub fn result(&self, index: usize) -> &OwnedBuffer {
        match self.ret_aliases.get(index).copied().flatten() {
            Some(arg) => &self.args.owned[arg],
            None => &self.rets.owned[index],
        }
    }

    /// The metadata the handler filled in (metadata frames only).
    pub fn metadata(&self) -> Option<&XLA_FFI_Metadata> {
        self.metadata.as_ref().map(|m| &m.1)
    }
}

/// Builds call frames for the fake runtime.
pub struct FrameBuilder {
    stage: sys::XLA_FFI_ExecutionStage,
    args: Vec<OwnedBuffer>,
    rets: Vec<OwnedBuffer>,
    arg_devices: Vec<Option<usize>>,
    ret_devices: Vec<Option<usize>>,
    /// For each result, the argument whose buffer it is (XLA's `input_output_aliases`).
    ret_aliases: Vec<Option<usize>>,
    attrs: Vec<(String, OwnedAttr)>,
    metadata: bool,
    api: *const XLA_FFI_Api,
}

impl FrameBuilder {
    /// A frame of `stage` with no operands or attributes, and the fake API table.
    pub fn new(stage: super::Stage) -> Self {
        FrameBuilder {
            stage: stage.to_raw(),
            args: Vec::new(),
            rets: Vec::new(),
            arg_devices: Vec::new(),
            ret_devices: Vec::new(),
            ret_aliases: Vec::new(),
            attrs: Vec::new(),
            metadata: false,
            api: api(),
        }
    }

    /// A frame carrying the metadata extension, as XLA sends at registration.
    pub fn metadata() -> Self {
        let mut b = FrameBuilder::new(super::Stage::Execute);
        b.metadata = true;
        b
    }

    /// Adds an argument in host memory.
    pub fn arg(mut self, buffer: OwnedBuffer) -> Self {
        self.args.push(buffer);
        self.arg_devices.push(None);
        self
    }

    /// Adds a result in host memory.
    pub fn ret(mut self, buffer: OwnedBuffer) -> Self {
        self.rets.push(buffer);
        self.ret_devices.push(None);
        self.ret_aliases.push(None);
        self
    }

    /// Adds a result that is argument `arg`'s buffer, as XLA passes a result aliased with an
    /// argument (`input_output_aliases`): same dtype, dims and memory. The handler's writes land
    /// in the argument; [`BuiltFrame::result`] reads them there.
    pub fn ret_in_place_of(mut self, arg: usize) -> Self {
        let argument = self.args[arg].clone();
        self.rets.push(OwnedBuffer {
            data: Vec::new(),
            ..argument
        });
        self.ret_devices.push(self.arg_devices[arg]);
        self.ret_aliases.push(Some(arg));
        self
    }

    /// An argument in device memory at `address` (which the test owns), as a GPU runtime
    /// passes it: dtype and dims, and a pointer the host must not read.
    pub fn device_arg(mut self, dtype: DataType, dims: &[i64], address: usize) -> Self {
        self.args.push(OwnedBuffer::zeros(dtype, dims));
        self.arg_devices.push(Some(address));
        self
    }

    /// A result in device memory at `address`; see [`FrameBuilder::device_arg`].
    pub fn device_ret(mut self, dtype: DataType, dims: &[i64], address: usize) -> Self {
        self.rets.push(OwnedBuffer::zeros(dtype, dims));
        self.ret_devices.push(Some(address));
        self.ret_aliases.push(None);
        self
    }

    /// Adds an attribute; the list is sorted by name when built, as XLA does.
    pub fn attr(mut self, name: &str, value: OwnedAttr) -> Self {
        self.attrs.push((name.to_string(), value));
        self
    }

    /// Uses another API table (e.g. from [`api_with_size`], or null).
    pub fn api(mut self, api: *const XLA_FFI_Api) -> Self {
        self.api = api;
        self
    }

    /// Lays out the frame and everything it points to, with `ctx` as its execution context.
    pub fn build(self, ctx: &FakeContext) -> BuiltFrame {
        let mut args = BuiltBuffers::new(self.args, &self.arg_devices);
        let mut rets = BuiltBuffers::new(self.rets, &self.ret_devices);
        for (r, alias) in self.ret_aliases.iter().enumerate() {
            if let Some(a) = *alias {
                rets.raw[r].data = args.raw[a].data;
            }
        }
        let mut attrs = BuiltAttrs::new(&self.attrs);
        let mut metadata = self.metadata.then(|| {
            Box::new((
                XLA_FFI_Metadata_Extension {
                    extension_base: XLA_FFI_Extension_Base {
                        struct_size: XLA_FFI_Metadata_Extension::STRUCT_SIZE,
                        r#type: XLA_FFI_Extension_Type::Metadata,
                        next: ptr::null_mut(),
                    },
                    metadata: ptr::null_mut(),
                },
                XLA_FFI_Metadata {
                    struct_size: XLA_FFI_Metadata::STRUCT_SIZE,
                    api_version: XLA_FFI_Api_Version {
                        struct_size: XLA_FFI_Api_Version::STRUCT_SIZE,
                        extension_start: ptr::null_mut(),
                        major_version: -1,
                        minor_version: -1,
                    },
                    traits: 0xdead,
                    state_type_id: XLA_FFI_TypeId { type_id: -1 },
                },
            ))
        });
        let extension_start = match metadata.as_mut() {
            Some(m) => {
                m.0.metadata = &mut m.1;
                (&mut m.0 as *mut XLA_FFI_Metadata_Extension).cast()
            }
            None => ptr::null_mut(),
        };
        let frame = Box::new(XLA_FFI_CallFrame {
            struct_size: XLA_FFI_CallFrame::STRUCT_SIZE,
            extension_start,
            api: self.api,
            ctx: ctx.as_raw(),
            stage: self.stage,
            args: XLA_FFI_Args {
                struct_size: XLA_FFI_Args::STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                size: args.ptrs.len() as i64,
                types: args.types.as_mut_ptr().cast(),
                args: args.ptrs.as_mut_ptr(),
            },
            rets: XLA_FFI_Rets {
                struct_size: XLA_FFI_Rets::STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                size: rets.ptrs.len() as i64,
                types: rets.types.as_mut_ptr().cast(),
                rets: rets.ptrs.as_mut_ptr(),
            },
            attrs: *attrs.raw,
            future: ptr::null_mut(),
        });
        // The frame holds the attribute list by value; keep `attrs.raw` in sync for tests
        // that inspect it.
        attrs.raw.struct_size = frame.attrs.struct_size;
        BuiltFrame {
            frame,
            args,
            rets,
            attrs,
            metadata,
            ret_aliases: self.ret_aliases,
        }
    }
}
