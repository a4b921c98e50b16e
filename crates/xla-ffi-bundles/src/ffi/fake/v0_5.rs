//! The fake runtime's API 0.5: the two functions 0.5 appended to the table (extension lookup,
//! custom options), and a collectives extension (type 129) that a test attaches to a context,
//! which records what the handler requests and hands out a communicator per request.

use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;

use parking_lot::Mutex;

use super::super::error::ErrorCode;
use super::super::sys::{self, v0_5};
use super::{fake_ctx, make_error, BuiltAttrs, FakeContext};

/// The 0.3 `table` grown to 0.5: its version, its size and the two appended functions.
pub(super) fn grow(mut table: sys::XLA_FFI_Api) -> v0_5::XLA_FFI_Api {
    table.struct_size = v0_5::XLA_FFI_Api::STRUCT_SIZE;
    table.api_version.minor_version = v0_5::XLA_FFI_API_MINOR;
    v0_5::XLA_FFI_Api {
        v0_3: table,
        XLA_FFI_InvokeContext_FindExtension: Some(find_extension),
        XLA_FFI_CustomOptions_Get: Some(custom_options_get),
    }
}

unsafe extern "C" fn find_extension(
    args: *mut v0_5::XLA_FFI_InvokeContext_FindExtension_Args,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: valid args from the FFI layer; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&mut *args, fake_ctx((*args).ctx)) };
    let Some(ctx) = ctx else {
        return make_error(ErrorCode::Internal, "no context");
    };
    args.extension = match &ctx.collectives {
        Some(c) if args.extension_type == v0_5::XLA_FFI_Extension_Collectives => c.extension(),
        // XLA answers an extension it does not have with null, not an error.
        _ => ptr::null(),
    };
    ptr::null_mut()
}

/// An attribute list that is never changed after it is made, shared by the threads of a
/// context's calls.
pub struct FrozenAttrs(BuiltAttrs);
// SAFETY: never mutated after it is made; its pointers point into itself.
unsafe impl Sync for FrozenAttrs {}
// SAFETY: as above.
unsafe impl Send for FrozenAttrs {}

/// The empty dictionary, for contexts without options.
static EMPTY: once_cell::sync::Lazy<FrozenAttrs> =
    once_cell::sync::Lazy::new(|| FrozenAttrs(BuiltAttrs::new(&[])));

unsafe extern "C" fn custom_options_get(
    args: *mut v0_5::XLA_FFI_CustomOptions_Get_Args,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: valid args from the FFI layer; `ctx` is a FakeContext.
    let (args, ctx) = unsafe { (&mut *args, fake_ctx((*args).ctx)) };
    let Some(ctx) = ctx else {
        return make_error(ErrorCode::Internal, "no context");
    };
    let options = ctx.custom_options.as_ref().unwrap_or(&EMPTY);
    args.attrs = &*options.0.raw;
    ptr::null_mut()
}

/// One communicator request as the handler made it: mode, groups, communication id.
pub type Request = (i32, Vec<Vec<i64>>, i64);

/// What a collectives extension saw: the runtime's per-invocation state behind the extension's
/// `state` pointer, as a runtime keeps its own.
#[derive(Default)]
pub struct Recorded {
    /// The requests made, in order.
    pub requests: Mutex<Vec<Request>>,
    /// Handles given out: the index of the request plus one, as a pointer, so that a test can
    /// tell which request a communicator answers.
    pub handed_out: Mutex<Vec<usize>>,
}

/// A collectives extension: the C struct the runtime hands out, whose `state` points to what
/// it records.
pub struct FakeCollectives {
    extension: v0_5::XLA_FFI_Collectives_Extension,
    recorded: Arc<Recorded>,
}

// SAFETY: the C struct is never changed after it is made (its pointers are null, functions, or
// the `Arc`'s, which lives as long as it); what changes is behind the mutexes of `Recorded`.
unsafe impl Sync for FakeCollectives {}
// SAFETY: as above.
unsafe impl Send for FakeCollectives {}

impl FakeCollectives {
    /// An extension of `version` (the mirror's is (0, 2)).
    pub fn new(version: (i32, i32)) -> FakeCollectives {
        let recorded = Arc::new(Recorded::default());
        FakeCollectives {
            extension: v0_5::XLA_FFI_Collectives_Extension {
                extension_base: v0_5::XLA_FFI_Extension {
                    struct_size: v0_5::XLA_FFI_Collectives_Extension::STRUCT_SIZE,
                    id: v0_5::XLA_FFI_ExtensionId {
                        extension_type: v0_5::XLA_FFI_Extension_Collectives,
                        major_version: version.0,
                        minor_version: version.1,
                    },
                    next: ptr::null(),
                },
                state: Arc::as_ptr(&recorded).cast_mut().cast(),
                request_communicator: Some(request_communicator),
                get_communicator: Some(get_communicator),
                request_window: None,
                get_window: None,
            },
            recorded,
        }
    }

    /// The extension, as the runtime hands it out: a pointer to the whole struct (its head is
    /// its first field), through which its functions read `state`.
    pub(super) fn extension(&self) -> *const v0_5::XLA_FFI_Extension {
        ptr::addr_of!(self.extension).cast()
    }
}

/// What the extension `this` records.
///
/// # Safety
/// `this` must be a `FakeCollectives`' extension, alive for `'a`.
unsafe fn recorded<'a>(this: *const v0_5::XLA_FFI_Collectives_Extension) -> &'a Recorded {
    // SAFETY: the extension's `state` is its `Recorded` (`FakeCollectives::new`), shared and
    // alive as long as the extension (caller's contract).
    unsafe { &*ptr::addr_of!((*this).state).read().cast::<Recorded>() }
}

/// The request an args struct describes.
///
/// # Safety
/// `args` must point to valid request args whose groups are readable.
unsafe fn read_request(args: &v0_5::XLA_FFI_Communicator_Request_Args) -> Request {
    let groups = (0..args.num_groups)
        .map(|g| {
            // SAFETY: `num_groups` groups (caller's contract).
            let group = unsafe { &*args.groups.add(g) };
            if group.size == 0 {
                return Vec::new();
            }
            // SAFETY: a group of `size` > 0 ids points to them (caller's contract).
            unsafe { std::slice::from_raw_parts(group.ids, group.size) }.to_vec()
        })
        .collect();
    (args.group_mode.0, groups, args.communication_id)
}

unsafe extern "C" fn request_communicator(
    this: *const v0_5::XLA_FFI_Collectives_Extension,
    args: *mut v0_5::XLA_FFI_Communicator_Request_Args,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: `this` is a FakeCollectives' extension (the fake hands out no other); args are
    // valid for the call.
    let (recorded, args) = unsafe { (recorded(this), &*args) };
    if args.struct_size < v0_5::XLA_FFI_Communicator_Request_Args::STRUCT_SIZE {
        return make_error(ErrorCode::InvalidArgument, "request args too small");
    }
    // SAFETY: valid args.
    let request = unsafe { read_request(args) };
    recorded.requests.lock().push(request);
    ptr::null_mut()
}

unsafe extern "C" fn get_communicator(
    this: *const v0_5::XLA_FFI_Collectives_Extension,
    args: *mut v0_5::XLA_FFI_Communicator_Get_Args,
) -> *mut sys::XLA_FFI_Error {
    // SAFETY: as in `request_communicator`.
    let (recorded, args) = unsafe { (recorded(this), &mut *args) };
    if args.request.struct_size < v0_5::XLA_FFI_Communicator_Get_Args::STRUCT_SIZE {
        return make_error(ErrorCode::InvalidArgument, "get args too small");
    }
    // SAFETY: valid args.
    let wanted = unsafe { read_request(&args.request) };
    let Some(index) = recorded.requests.lock().iter().position(|r| *r == wanted) else {
        return make_error(
            ErrorCode::NotFound,
            &format!("no clique was requested for {wanted:?}"),
        );
    };
    recorded.handed_out.lock().push(index + 1);
    args.communicator = (index + 1) as *mut c_void as *mut v0_5::XLA_FFI_Communicator;
    ptr::null_mut()
}

impl FakeContext {
    /// Attaches a collectives extension of `version` to this context's calls (an API 0.5
    /// runtime that supports it).
    pub fn attach_collectives(&mut self, version: (i32, i32)) {
        self.collectives = Some(FakeCollectives::new(version));
    }

    /// What the collectives extension [`FakeContext::attach_collectives`] attached recorded.
    pub fn collectives(&self) -> &Recorded {
        &self
            .collectives
            .as_ref()
            .expect("no collectives extension attached")
            .recorded
    }

    /// Passes `options` as this context's custom options (API 0.5).
    pub fn set_custom_options(&mut self, options: &[(String, super::OwnedAttr)]) {
        self.custom_options = Some(FrozenAttrs(BuiltAttrs::new(options)));
    }
}
