//! A checked handle on the `XLA_FFI_Api` function table.
//!
//! The table may come from a runtime older (smaller) or newer (larger) than this mirror. Every
//! function is looked up through `api_fn!`, which first checks that the table's `struct_size`
//! covers the field, and that the pointer is set, so an old runtime gives an error naming the
//! missing function instead of a jump through garbage.

use std::ffi::{c_char, CStr, CString};
use std::marker::PhantomData;
use std::mem::{offset_of, size_of};
use std::ptr::{self, NonNull};

use super::error::{ErrorCode, FfiError, FfiResult};
use super::sys;

/// The API table a call frame came with, valid for the duration of that call (`'a`).
#[derive(Clone, Copy)]
pub struct Api<'a> {
    raw: NonNull<sys::XLA_FFI_Api>,
    _life: PhantomData<&'a sys::XLA_FFI_Api>,
}

// SAFETY: the table is immutable function pointers owned by the XLA runtime for the life of the
// process; XLA calls handlers from many threads with the same table.
unsafe impl Send for Api<'_> {}
// SAFETY: as above, nothing in the table is mutated after XLA creates it.
unsafe impl Sync for Api<'_> {}

/// Looks up one function of the table, checking `struct_size` and presence: a 0.3 function by
/// its field, a function API 0.5 appended by `v0_5, field` (which also checks that the runtime
/// says it speaks 0.5: a table's size alone does not say which version laid it out).
macro_rules! api_fn {
    ($api:expr, v0_5, $field:ident) => {
        $api.function_since(
            $crate::ffi::sys::v0_5::XLA_FFI_API_MINOR,
            ::std::mem::offset_of!($crate::ffi::sys::v0_5::XLA_FFI_Api, $field),
            stringify!($field),
            // SAFETY: as below; a 0.5 table starts with the 0.3 one, so the pointer to the
            // table is a pointer to the 0.5 struct wherever its version and struct_size say so
            // (both checked by `function_since` before this runs).
            |table| unsafe {
                ::std::ptr::addr_of!((*table.cast::<$crate::ffi::sys::v0_5::XLA_FFI_Api>()).$field)
                    .read()
            },
        )
    };
    ($api:expr, $field:ident) => {
        $api.function(
            ::std::mem::offset_of!($crate::ffi::sys::XLA_FFI_Api, $field),
            stringify!($field),
            // SAFETY: `function` only calls this after checking that the table's struct_size
            // covers the field, so the read stays inside the table XLA allocated.
            |table| unsafe { ::std::ptr::addr_of!((*table).$field).read() },
        )
    };
}
pub(crate) use api_fn;

/// The smallest table we can work with: one that can at least create errors.
const MIN_API_SIZE: usize =
    offset_of!(sys::XLA_FFI_Api, XLA_FFI_Error_Destroy) + size_of::<usize>();

impl<'a> Api<'a> {
    /// Wraps a table pointer.
    ///
    /// # Safety
    /// `raw` must be null or point to an `XLA_FFI_Api` whose first field (`struct_size`) is
    /// readable and tells how many bytes of it are valid, for at least `'a`.
    pub unsafe fn from_raw(raw: *const sys::XLA_FFI_Api) -> FfiResult<Api<'a>> {
        let raw = NonNull::new(raw.cast_mut())
            .ok_or_else(|| FfiError::internal("the call frame has no XLA_FFI_Api table"))?;
        // SAFETY: the caller guarantees `struct_size` is readable.
        let size = unsafe { ptr::addr_of!((*raw.as_ptr()).struct_size).read() };
        if size < MIN_API_SIZE {
            return Err(FfiError::internal(format!(
                "unexpected XLA_FFI_Api size: expected at least {MIN_API_SIZE}, got {size}"
            )));
        }
        Ok(Api {
            raw,
            _life: PhantomData,
        })
    }

    /// The raw table pointer.
    pub fn as_ptr(&self) -> *const sys::XLA_FFI_Api {
        self.raw.as_ptr()
    }

    /// The table's declared size in bytes.
    pub fn struct_size(&self) -> usize {
        // SAFETY: `from_raw` checked that the field is readable.
        unsafe { ptr::addr_of!((*self.raw.as_ptr()).struct_size).read() }
    }

    /// The API version the runtime declares.
    pub fn version(&self) -> (i32, i32) {
        let end = offset_of!(sys::XLA_FFI_Api, api_version) + size_of::<sys::XLA_FFI_Api_Version>();
        if self.struct_size() < end {
            return (0, 0);
        }
        // SAFETY: the table covers `api_version` (checked just above).
        let v = unsafe { ptr::addr_of!((*self.raw.as_ptr()).api_version).read() };
        (v.major_version, v.minor_version)
    }

    #[doc(hidden)]
    pub fn function<F>(
        &self,
        offset: usize,
        name: &'static str,
        read: impl FnOnce(*const sys::XLA_FFI_Api) -> Option<F>,
    ) -> FfiResult<F> {
        if self.struct_size() < offset + size_of::<usize>() {
            let (major, minor) = self.version();
            return Err(FfiError::Unimplemented(format!(
                "the XLA runtime's API table (version {major}.{minor}, {} bytes) ends before \
                 {name}",
                self.struct_size()
            )));
        }
        read(self.raw.as_ptr()).ok_or_else(|| {
            FfiError::Unimplemented(format!("the XLA runtime does not provide {name}"))
        })
    }

    /// [`Api::function`] for a function API 0.`minor` added: refused, naming both versions,
    /// where the runtime says it speaks an older one.
    #[doc(hidden)]
    pub fn function_since<F>(
        &self,
        minor: i32,
        offset: usize,
        name: &'static str,
        read: impl FnOnce(*const sys::XLA_FFI_Api) -> Option<F>,
    ) -> FfiResult<F> {
        if !self.speaks(minor) {
            let (major, actual) = self.version();
            return Err(FfiError::Unimplemented(format!(
                "{name} is XLA FFI API 0.{minor}'s; the runtime speaks {major}.{actual} (a newer \
                 jaxlib has it)"
            )));
        }
        self.function(offset, name, read)
    }

    /// Builds an `XLA_FFI_Error` owned by the caller (XLA, when returned from a handler).
    pub fn create_error(&self, error: &FfiError) -> *mut sys::XLA_FFI_Error {
        self.create_error_raw(error.code(), &error.to_string())
    }

    pub(crate) fn create_error_raw(
        &self,
        code: ErrorCode,
        message: &str,
    ) -> *mut sys::XLA_FFI_Error {
        let Ok(create) = api_fn!(self, XLA_FFI_Error_Create) else {
            return ptr::null_mut();
        };
        // Interior NULs would cut the message short; XLA copies the string.
        let message = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
        let mut args = sys::XLA_FFI_Error_Create_Args {
            struct_size: sys::XLA_FFI_Error_Create_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            message: message.as_ptr(),
            errc: code.to_raw(),
        };
        // SAFETY: `args` is a valid, initialised struct that outlives the call, and `message`
        // lives until after XLA has copied it.
        unsafe { create(&mut args) }
    }

    /// Whether the runtime speaks API 0.`minor` or a newer 0.x (another major version breaks
    /// compatibility: its table need not start with this one).
    pub fn speaks(&self, minor: i32) -> bool {
        let (major, actual) = self.version();
        major == sys::XLA_FFI_API_MAJOR && actual >= minor
    }

    /// Turns an error returned by an API call into an [`FfiError`] and destroys the original.
    /// Its code is the runtime's where the runtime says it (API 0.5's `GetDetails`), else
    /// `Unknown`.
    pub(crate) fn take_error(
        &self,
        call: &'static str,
        error: *mut sys::XLA_FFI_Error,
    ) -> FfiError {
        let (code, message) = self.error_details(error);
        if let Ok(destroy) = api_fn!(self, XLA_FFI_Error_Destroy) {
            let mut args = sys::XLA_FFI_Error_Destroy_Args {
                struct_size: sys::XLA_FFI_Error_Destroy_Args::STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                error,
            };
            // SAFETY: `error` came from this runtime and is owned by us; it is not used again.
            unsafe { destroy(&mut args) };
        }
        FfiError::Runtime {
            call,
            code,
            message,
        }
    }

    /// The code and message of an error, copied out. The code is `Unknown` where the runtime
    /// cannot say it: API 0.3's `GetMessage` has no code, and 0.5's `GetDetails` writes it only
    /// into args that declare the 0.5 size (a 0.3 runtime may check for its own size, so those
    /// get the 0.3 args).
    pub(crate) fn error_details(&self, error: *mut sys::XLA_FFI_Error) -> (ErrorCode, String) {
        let Ok(get) = api_fn!(self, XLA_FFI_Error_GetMessage) else {
            return (
                ErrorCode::Unknown,
                "(no message: the runtime lacks XLA_FFI_Error_GetMessage)".to_string(),
            );
        };
        let v0_5 = self.speaks(sys::v0_5::XLA_FFI_API_MINOR);
        let mut args = sys::v0_5::XLA_FFI_Error_GetDetails_Args {
            v0_3: sys::XLA_FFI_Error_GetMessage_Args {
                struct_size: if v0_5 {
                    sys::v0_5::XLA_FFI_Error_GetDetails_Args::STRUCT_SIZE
                } else {
                    sys::XLA_FFI_Error_GetMessage_Args::STRUCT_SIZE
                },
                extension_start: ptr::null_mut(),
                error,
                message: ptr::null(),
            },
            errc: sys::XLA_FFI_Error_Code::UNKNOWN,
        };
        // SAFETY: `args` is valid for the call and as large as the size it declares (the 0.5
        // struct starts with the 0.3 one, and the pointer covers all of it); `error` is an
        // error of this runtime.
        unsafe { get(ptr::addr_of_mut!(args).cast()) };
        let code = if v0_5 {
            ErrorCode::from_raw(args.errc)
        } else {
            ErrorCode::Unknown
        };
        (code, c_string(args.v0_3.message))
    }

    /// Calls an API function that returns an error, mapping the error.
    pub(crate) fn check(
        &self,
        call: &'static str,
        error: *mut sys::XLA_FFI_Error,
    ) -> FfiResult<()> {
        if error.is_null() {
            Ok(())
        } else {
            Err(self.take_error(call, error))
        }
    }
}

/// Futures: the completion of an execution that a handler finishes later (XLA's `ffi::Future`).
impl Api<'_> {
    /// A new pending future, owned by the runtime once a handler returns it in its call frame.
    pub(crate) fn future_create(&self) -> FfiResult<*mut sys::XLA_FFI_Future> {
        let create = api_fn!(self, XLA_FFI_Future_Create)?;
        let mut args = sys::XLA_FFI_Future_Create_Args {
            struct_size: sys::XLA_FFI_Future_Create_Args::STRUCT_SIZE,
            extension_start: ptr::null_mut(),
            future: ptr::null_mut(),
        };
        // SAFETY: `args` is valid for the call; the runtime writes the new future into it.
        self.check("XLA_FFI_Future_Create", unsafe { create(&mut args) })?;
        if args.future.is_null() {
            return Err(FfiError::internal(
                "XLA_FFI_Future_Create gave a null future",
            ));
        }
        Ok(args.future)
    }

    /// Completes `future`: available, or failed with `error` (code and message).
    ///
    /// # Safety
    /// `future` must come from [`Api::future_create`] of this runtime and not be completed yet;
    /// it must not be used after this call.
    pub(crate) unsafe fn future_complete(
        &self,
        future: *mut sys::XLA_FFI_Future,
        error: Option<&FfiError>,
        message: impl FnOnce(&FfiError) -> String,
    ) -> FfiResult<()> {
        match error {
            None => {
                let set = api_fn!(self, XLA_FFI_Future_SetAvailable)?;
                let mut args = sys::XLA_FFI_Future_SetAvailable_Args {
                    struct_size: sys::XLA_FFI_Future_SetAvailable_Args::STRUCT_SIZE,
                    extension_start: ptr::null_mut(),
                    future,
                };
                // SAFETY: a pending future of this runtime (caller's contract).
                self.check("XLA_FFI_Future_SetAvailable", unsafe { set(&mut args) })
            }
            Some(e) => {
                let set = api_fn!(self, XLA_FFI_Future_SetError)?;
                let mut args = sys::XLA_FFI_Future_SetError_Args {
                    struct_size: sys::XLA_FFI_Future_SetError_Args::STRUCT_SIZE,
                    extension_start: ptr::null_mut(),
                    future,
                    // The runtime takes ownership of the error.
                    error: self.create_error_raw(e.code(), &message(e)),
                };
                // SAFETY: as above.
                self.check("XLA_FFI_Future_SetError", unsafe { set(&mut args) })
            }
        }
    }
}

/// Copies a NUL-terminated C string, or says that there was none.
fn c_string(ptr: *const c_char) -> String {
    if ptr.is_null() {
        return "(no message)".to_string();
    }
    // SAFETY: XLA returns a NUL-terminated string that lives as long as the error.
    unsafe { CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}
