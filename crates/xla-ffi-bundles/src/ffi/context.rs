//! The execution context: state, stream, device, XLA's thread pool, device memory, run id.
//!
//! A [`Context`] is valid for one handler call (`'a`). Everything it returns that outlives the
//! call (the state) is owned by XLA, not by the context.

use std::ffi::c_void;
use std::ptr::{self, NonNull};

use super::api::{api_fn, Api};
use super::attrs::Attrs;
use super::collectives::Collectives;
use super::error::{FfiError, FfiResult};
use super::panic;
use super::stage::Stage;
use super::sys;
use super::types::{StateType, StateTypeRegistration};

/// A platform stream (`CUstream` on CUDA), never dereferenced by this crate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream(*mut c_void);

impl Stream {
    /// A stream handle from its raw value (tests and tools that make their own streams); safe
    /// because the crate never dereferences it, only hands it back to the driver.
    pub fn from_raw(raw: *mut c_void) -> Stream {
        Stream(raw)
    }

    /// The raw stream handle, e.g. for a kernel launch.
    pub fn as_raw(&self) -> *mut c_void {
        self.0
    }
}

/// An extension the runtime attached to a call (API 0.5), valid for the call (`'a`).
#[derive(Debug, Clone, Copy)]
pub struct Extension<'a> {
    raw: NonNull<sys::v0_5::XLA_FFI_Extension>,
    _life: std::marker::PhantomData<&'a sys::v0_5::XLA_FFI_Extension>,
}

impl Extension<'_> {
    /// Its type, major and minor version.
    pub fn id(&self) -> sys::v0_5::XLA_FFI_ExtensionId {
        // SAFETY: the extension lives for the call (`'a`), and its head is readable.
        unsafe { ptr::addr_of!((*self.raw.as_ptr()).id).read() }
    }

    /// The extension, for a handler that reads one this crate does not wrap.
    pub fn as_ptr(&self) -> *const sys::v0_5::XLA_FFI_Extension {
        self.raw.as_ptr()
    }
}

/// The context of one handler call.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    api: Api<'a>,
    ctx: *mut sys::XLA_FFI_ExecutionContext,
    stage: Stage,
    keeps_stage_state: bool,
}

impl<'a> Context<'a> {
    pub(crate) fn new(
        api: Api<'a>,
        ctx: *mut sys::XLA_FFI_ExecutionContext,
        stage: Stage,
        keeps_stage_state: bool,
    ) -> Self {
        Context {
            api,
            ctx,
            stage,
            keeps_stage_state,
        }
    }

    /// The stage this call runs.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The API table this call came with.
    pub fn api(&self) -> Api<'a> {
        self.api
    }

    fn require_ctx(&self, what: &str) -> FfiResult<()> {
        if self.ctx.is_null() {
            return Err(FfiError::internal(format!(
                "cannot get {what}: the call has no context"
            )));
        }
        Ok(())
    }

    /// `T`'s registration, checked to be `T`'s and to have an id from XLA.
    fn registered<T: StateType>(what: &str) -> FfiResult<&'static StateTypeRegistration> {
        let registration = T::registration();
        registration.check_type::<T>()?;
        if registration.type_id() == 0 {
            return Err(FfiError::failed_precondition(format!(
                "{what} type `{}` is not registered with XLA (declare it on the bundle: \
                 `.prepare_state::<T>()`, `.initialize_state::<T>()` or `.user_data::<T>()`; \
                 an instantiate state is the bundle's `State`)",
                registration.name()
            )));
        }
        Ok(registration)
    }

    /// The state made by this call site's instantiate stage.
    pub fn state<T: StateType>(&self) -> FfiResult<&'a T> {
        self.require_ctx("the state")?;
        let registration = Self::registered::<T>("state")?;
        // SAFETY: `get_state` returns a pointer that XLA stored with `T`'s type id.
        let state = unsafe { self.get_state(Stage::Instantiate, registration) }?;
        let state = NonNull::new(state.cast::<T>()).ok_or_else(|| {
            FfiError::failed_precondition(format!(
                "no `{}` state: the instantiate stage did not run for this call site",
                registration.name()
            ))
        })?;
        // SAFETY: XLA checked that the state was stored with `T`'s type id, so it is the
        // `Box<T>` our instantiate stage handed over; XLA keeps it alive until the executable
        // (and so every call of it) is gone, and we only ever share it.
        Ok(unsafe { &*state.as_ptr() })
    }

    /// Hands `state` to XLA for this call site; XLA drops it with the executable.
    pub(crate) fn set_state<T: StateType>(&self, state: T) -> FfiResult<()> {
        self.require_ctx("the state")?;
        let registration = Self::registered::<T>("state")?;
        self.put_state(Stage::Instantiate, registration, state)
            .map(|_| ())
    }

    /// Why a prepare- or initialize-stage state of `stage` cannot be used from this call, if it
    /// cannot: XLA keeps one per stage and per execution on device platforms only, and not for
    /// calls it may record into a command buffer (in both cases its call would dereference a
    /// null pointer), and none for the execute stage.
    fn check_stage_state(&self, stage: Stage, what: &str) -> FfiResult<()> {
        if !self.keeps_stage_state {
            return Err(FfiError::failed_precondition(format!(
                "cannot {what} the {stage}-stage state: XLA keeps none for this bundle (XLA:CPU \
                 runs no prepare or initialize stage; XLA:GPU keeps none for a \
                 command-buffer-compatible bundle); keep per-call-site data in the instantiate \
                 state"
            )));
        }
        if !matches!(stage, Stage::Prepare | Stage::Initialize) {
            return Err(FfiError::invalid_argument(format!(
                "cannot {what} a {stage}-stage state here: XLA keeps prepare- and \
                 initialize-stage states (the instantiate state is `Context::state`)"
            )));
        }
        Ok(())
    }

    /// The state that this execution's `stage` (prepare or initialize) stored with
    /// [`Context::set_stage_state`], from that stage or a later one of the same execution.
    ///
    /// On XLA:GPU these states live for one execution on one device: made by its prepare or
    /// initialize stage, readable by its execute stage, dropped when the execution returns on
    /// the host (not when the device work ends, so device work must not read them). XLA:CPU
    /// keeps none: there this is an error, as is asking for the execute stage's.
    pub fn stage_state<T: StateType>(&self, stage: Stage) -> FfiResult<&'a T> {
        self.require_ctx("a stage state")?;
        self.check_stage_state(stage, "get")?;
        let registration = Self::registered::<T>("stage state")?;
        // SAFETY: as in `state`.
        let state = unsafe { self.get_state(stage, registration) }.map_err(|e| {
            FfiError::failed_precondition(format!(
                "no `{}` state from the {stage} stage of this execution: {e}",
                registration.name()
            ))
        })?;
        let state = NonNull::new(state.cast::<T>()).ok_or_else(|| {
            FfiError::failed_precondition(format!(
                "no `{}` state from the {stage} stage of this execution",
                registration.name()
            ))
        })?;
        // SAFETY: XLA checked the type id; the state is the `Box<T>` a stage of this
        // execution handed over, which XLA keeps until the execution returns, after this call.
        Ok(unsafe { &*state.as_ptr() })
    }

    /// Hands `state` to XLA as the state of this call's stage (prepare or initialize), for
    /// this stage and the later ones of the same execution ([`Context::stage_state`]); XLA
    /// drops it when the execution returns. One per stage and execution: a second is XLA's
    /// error. Refused on XLA:CPU and in the instantiate and execute stages.
    pub fn set_stage_state<T: StateType>(&self, state: T) -> FfiResult<&'a T> {
        self.require_ctx("a stage state")?;
        self.check_stage_state(self.stage, "set")?;
        let registration = Self::registered::<T>("stage state")?;
        let raw = self
            .put_state(self.stage, registration, state)
            .map_err(|e| {
                FfiError::failed_precondition(format!(
                    "cannot set a `{}` state for the {} stage of this execution (XLA keeps one \
                     per stage and execution): {e}",
                    registration.name(),
                    self.stage
                ))
            })?;
        // SAFETY: XLA took `raw` (a live `Box<T>`) and frees it only when the execution
        // returns, after this call; we only share it from here on.
        Ok(unsafe { &*raw })
    }

    /// Data of type `T` that the program running XLA attached to this execution (PjRt's
    /// `ExecuteOptions::context`, XLA's `ffi::UserData<T>`). JAX attaches none that a
    /// handler can name, so through JAX this is XLA's "not found" error; a C++ embedder of
    /// PjRt can pass some. `T`'s type must be registered (`.user_data::<T>()` on the bundle).
    pub fn user_data<T: StateType>(&self) -> FfiResult<&'a T> {
        self.require_ctx("user data")?;
        let registration = Self::registered::<T>("user data")?;
        let get = api_fn!(self.api, XLA_FFI_ExecutionContext_Get)?;
        let mut args = sys::XLA_FFI_ExecutionContext_Get_Args {
            struct_size: sys::XLA_FFI_ExecutionContext_Get_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            type_id: registration.type_id_ptr(),
            data: ptr::null_mut(),
        };
        // SAFETY: `args` is valid for the call; `ctx` is this call's context.
        let err = unsafe { get(&mut args) };
        self.api
            .check("XLA_FFI_ExecutionContext_Get", err)
            .map_err(|e| {
                FfiError::failed_precondition(format!(
                    "no user data of type `{}` in this execution: {e}",
                    registration.name()
                ))
            })?;
        let data = NonNull::new(args.data.cast::<T>()).ok_or_else(|| {
            FfiError::failed_precondition(format!(
                "no user data of type `{}` in this execution (XLA returned null)",
                registration.name()
            ))
        })?;
        // SAFETY: XLA looked the data up by `T`'s type id, so it was attached as a `T`; the
        // execution context that owns it outlives every handler call of the execution.
        Ok(unsafe { &*data.as_ptr() })
    }

    /// The extension of type `extension_type` the runtime attached to this call (API 0.5's
    /// `XLA_FFI_InvokeContext_FindExtension`): `None` where it attached none of that type, and
    /// on runtimes older than 0.5, which have no extensions.
    pub fn find_extension(&self, extension_type: i64) -> FfiResult<Option<Extension<'a>>> {
        if !self.api.speaks(sys::v0_5::XLA_FFI_API_MINOR) {
            return Ok(None);
        }
        self.require_ctx("an extension")?;
        let find = api_fn!(self.api, v0_5, XLA_FFI_InvokeContext_FindExtension)?;
        let mut args = sys::v0_5::XLA_FFI_InvokeContext_FindExtension_Args {
            struct_size: sys::v0_5::XLA_FFI_InvokeContext_FindExtension_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            extension_type,
            extension: ptr::null(),
        };
        // SAFETY: `args` is valid for the call; `ctx` is this call's context.
        let err = unsafe { find(&mut args) };
        self.api.check("XLA_FFI_InvokeContext_FindExtension", err)?;
        let Some(raw) = NonNull::new(args.extension.cast_mut()) else {
            return Ok(None);
        };
        // SAFETY: the runtime's extensions live as long as the invoke context, so for the call.
        let id = unsafe { ptr::addr_of!((*raw.as_ptr()).id).read() };
        if id.extension_type != extension_type {
            return Err(FfiError::internal(format!(
                "asked the runtime for extension {extension_type}, got {}",
                id.extension_type
            )));
        }
        Ok(Some(Extension {
            raw,
            _life: std::marker::PhantomData,
        }))
    }

    /// XLA's collectives extension for this call, if the runtime attached one (see
    /// [`super::collectives`] for which do).
    pub fn collectives(&self) -> FfiResult<Option<Collectives<'a>>> {
        let Some(extension) = self.find_extension(sys::v0_5::XLA_FFI_Extension_Collectives)? else {
            return Ok(None);
        };
        // SAFETY: the runtime attached `extension` as type 129 for the call.
        unsafe { Collectives::from_raw(extension.raw, self.api, self.stage) }.map(Some)
    }

    /// The options the program running XLA passed with this execution (API 0.5's custom
    /// options), apart from the call's own attributes: an empty list where none were passed (as
    /// through JAX, which passes none), `None` on runtimes older than 0.5.
    pub fn custom_options(&self) -> FfiResult<Option<Attrs<'a>>> {
        if !self.api.speaks(sys::v0_5::XLA_FFI_API_MINOR) {
            return Ok(None);
        }
        self.require_ctx("the custom options")?;
        let get = api_fn!(self.api, v0_5, XLA_FFI_CustomOptions_Get)?;
        let mut args = sys::v0_5::XLA_FFI_CustomOptions_Get_Args {
            struct_size: sys::v0_5::XLA_FFI_CustomOptions_Get_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            attrs: ptr::null(),
        };
        // SAFETY: `args` is valid for the call; `ctx` is this call's context.
        let err = unsafe { get(&mut args) };
        self.api.check("XLA_FFI_CustomOptions_Get", err)?;
        // SAFETY: the runtime's options are a dictionary laid out as the call's attributes,
        // owned by the invoke context, so valid for the call.
        unsafe { Attrs::from_raw(args.attrs) }
            .map(Some)
            .map_err(|e| FfiError::internal(format!("the runtime's custom options: {e}")))
    }

    /// XLA's state pointer for `stage` (null if XLA has none), stored with `registration`'s
    /// type id.
    ///
    /// # Safety
    /// `stage` must be one whose state XLA keeps on this platform (the instantiate stage, or
    /// prepare and initialize where `check_stage_state` allows them): for the others XLA
    /// dereferences a null pointer.
    unsafe fn get_state(
        &self,
        stage: Stage,
        registration: &'static StateTypeRegistration,
    ) -> FfiResult<*mut c_void> {
        let get = api_fn!(self.api, XLA_FFI_State_Get)?;
        let mut args = sys::XLA_FFI_State_Get_Args {
            struct_size: sys::XLA_FFI_State_Get_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            stage: stage.to_raw(),
            type_id: registration.type_id_ptr(),
            state: ptr::null_mut(),
        };
        // SAFETY: `args` is valid for the call; `ctx` is this call's context; the caller
        // vouches for the stage.
        let err = unsafe { get(&mut args) };
        self.api.check("XLA_FFI_State_Get", err)?;
        Ok(args.state)
    }

    /// Hands `state`, boxed, to XLA as `stage`'s state; on success XLA owns the box (freed by
    /// the type info's deleter) and its pointer is returned.
    fn put_state<T: StateType>(
        &self,
        stage: Stage,
        registration: &'static StateTypeRegistration,
        state: T,
    ) -> FfiResult<*mut T> {
        // Only the instantiate stage's own state, or a stage state that `check_stage_state`
        // allowed: the stages whose state XLA keeps.
        debug_assert!(stage == Stage::Instantiate || self.check_stage_state(stage, "set").is_ok());
        let set = api_fn!(self.api, XLA_FFI_State_Set)?;
        let raw = Box::into_raw(Box::new(state));
        let mut args = sys::XLA_FFI_State_Set_Args {
            struct_size: sys::XLA_FFI_State_Set_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            stage: stage.to_raw(),
            type_id: registration.type_id_ptr(),
            state: raw.cast(),
        };
        // SAFETY: `args` is valid for the call; on success XLA owns `raw` and frees it through
        // the type info's deleter.
        let err = unsafe { set(&mut args) };
        if !err.is_null() {
            // SAFETY: XLA refused the state, so it is still ours; free it once.
            drop(unsafe { Box::from_raw(raw) });
        }
        self.api.check("XLA_FFI_State_Set", err)?;
        Ok(raw)
    }

    /// The platform stream of this call (GPU); an error on platforms without streams.
    pub fn stream(&self) -> FfiResult<Stream> {
        self.require_ctx("the stream")?;
        let get = api_fn!(self.api, XLA_FFI_Stream_Get)?;
        let mut args = sys::XLA_FFI_Stream_Get_Args {
            struct_size: sys::XLA_FFI_Stream_Get_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            stream: ptr::null_mut(),
        };
        // SAFETY: `args` is valid for the call.
        let err = unsafe { get(&mut args) };
        self.api.check("XLA_FFI_Stream_Get", err)?;
        Ok(Stream(args.stream))
    }

    /// The ordinal of the device this call runs on.
    pub fn device_ordinal(&self) -> FfiResult<i32> {
        self.require_ctx("the device ordinal")?;
        let get = api_fn!(self.api, XLA_FFI_DeviceOrdinal_Get)?;
        let mut args = sys::XLA_FFI_DeviceOrdinal_Get_Args {
            struct_size: sys::XLA_FFI_DeviceOrdinal_Get_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            device_ordinal: -1,
        };
        // SAFETY: `args` is valid for the call.
        let err = unsafe { get(&mut args) };
        self.api.check("XLA_FFI_DeviceOrdinal_Get", err)?;
        Ok(args.device_ordinal)
    }

    /// The id of the logical execution this call belongs to.
    pub fn run_id(&self) -> FfiResult<i64> {
        self.require_ctx("the run id")?;
        let get = api_fn!(self.api, XLA_FFI_RunId_Get)?;
        let mut args = sys::XLA_FFI_RunId_Get_Args {
            struct_size: sys::XLA_FFI_RunId_Get_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            run_id: 0,
        };
        // SAFETY: `args` is valid for the call.
        let err = unsafe { get(&mut args) };
        self.api.check("XLA_FFI_RunId_Get", err)?;
        Ok(args.run_id)
    }

    /// The number of threads in XLA's intra-op thread pool (CPU).
    pub fn num_threads(&self) -> FfiResult<i64> {
        self.require_ctx("the thread pool")?;
        let get = api_fn!(self.api, XLA_FFI_ThreadPool_NumThreads)?;
        let mut num_threads: i64 = 0;
        let mut args = sys::XLA_FFI_ThreadPool_NumThreads_Args {
            struct_size: sys::XLA_FFI_ThreadPool_NumThreads_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            num_threads: &mut num_threads,
        };
        // SAFETY: `args` and `num_threads` are valid for the call.
        let err = unsafe { get(&mut args) };
        self.api.check("XLA_FFI_ThreadPool_NumThreads", err)?;
        Ok(num_threads)
    }

    /// Runs `task` on XLA's intra-op thread pool (CPU). XLA may run it on any pool thread, in
    /// any order, or on the calling thread; a caller that waits for it must not assume it runs
    /// in parallel. A panic in the task is caught and reported on stderr.
    pub fn schedule(&self, task: Box<dyn FnOnce() + Send + 'static>) -> FfiResult<()> {
        let data = Box::into_raw(Box::new(task));
        // SAFETY: `run_boxed_task` takes ownership of `data`, a `Box<Box<dyn FnOnce>>`.
        let result = unsafe { self.schedule_raw(run_boxed_task, data.cast()) };
        if result.is_err() {
            // SAFETY: the pool refused the task, so `data` is still ours; free it once.
            drop(unsafe { Box::from_raw(data) });
        }
        result
    }

    /// Schedules a raw task, for callers that keep their task data in preallocated storage.
    ///
    /// # Safety
    /// `data` must stay valid until `task` has run, and `task(data)` must be safe to call once
    /// from any thread. `task` must not unwind.
    pub unsafe fn schedule_raw(&self, task: sys::XLA_FFI_Task, data: *mut c_void) -> FfiResult<()> {
        self.require_ctx("the thread pool")?;
        let schedule = api_fn!(self.api, XLA_FFI_ThreadPool_Schedule)?;
        let mut args = sys::XLA_FFI_ThreadPool_Schedule_Args {
            struct_size: sys::XLA_FFI_ThreadPool_Schedule_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            task: Some(task),
            data,
        };
        // SAFETY: `args` is valid for the call; the caller vouches for `task` and `data`.
        let err = unsafe { schedule(&mut args) };
        self.api.check("XLA_FFI_ThreadPool_Schedule", err)
    }

    /// Allocates device memory bound to this call's device, freed when the value drops.
    pub fn allocate(&self, size: usize, alignment: usize) -> FfiResult<DeviceMemory<'a>> {
        self.require_ctx("device memory")?;
        let allocate = api_fn!(self.api, XLA_FFI_DeviceMemory_Allocate)?;
        let mut args = sys::XLA_FFI_DeviceMemory_Allocate_Args {
            struct_size: sys::XLA_FFI_DeviceMemory_Allocate_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx,
            size,
            alignment,
            data: ptr::null_mut(),
        };
        // SAFETY: `args` is valid for the call.
        let err = unsafe { allocate(&mut args) };
        self.api.check("XLA_FFI_DeviceMemory_Allocate", err)?;
        if args.data.is_null() && size > 0 {
            return Err(FfiError::ResourceExhausted(format!(
                "XLA returned no memory for an allocation of {size} bytes"
            )));
        }
        Ok(DeviceMemory {
            ctx: *self,
            data: args.data,
            size,
        })
    }
}

/// Device memory from [`Context::allocate`], returned to XLA on drop.
pub struct DeviceMemory<'a> {
    ctx: Context<'a>,
    data: *mut c_void,
    size: usize,
}

impl DeviceMemory<'_> {
    /// The device address, never dereferenced by this crate.
    pub fn device_ptr(&self) -> *mut c_void {
        self.data
    }

    /// The size of the allocation in bytes.
    pub fn size(&self) -> usize {
        self.size
    }
}

impl Drop for DeviceMemory<'_> {
    fn drop(&mut self) {
        let Ok(free) = api_fn!(self.ctx.api, XLA_FFI_DeviceMemory_Free) else {
            return;
        };
        let mut args = sys::XLA_FFI_DeviceMemory_Free_Args {
            struct_size: sys::XLA_FFI_DeviceMemory_Free_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            ctx: self.ctx.ctx,
            size: self.size,
            data: self.data,
        };
        // SAFETY: `data` was allocated by this context's allocator with `size` bytes and is
        // freed once.
        let err = unsafe { free(&mut args) };
        if let Err(e) = self.ctx.api.check("XLA_FFI_DeviceMemory_Free", err) {
            panic::report_unreturnable::<()>(Err(e));
        }
    }
}

/// The `XLA_FFI_Task` behind [`Context::schedule`].
unsafe extern "C" fn run_boxed_task(data: *mut c_void) {
    // SAFETY: `data` is the `Box<Box<dyn FnOnce>>` that `schedule` leaked; XLA runs each task
    // once.
    let task = unsafe { Box::from_raw(data.cast::<Box<dyn FnOnce() + Send + 'static>>()) };
    let result = panic::catch(
        || "a task on XLA's thread pool".to_string(),
        move || {
            task();
            Ok(())
        },
    );
    panic::report_unreturnable(result);
}
