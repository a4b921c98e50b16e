//! The C ABI of `xla/ffi/api/c_api.h`, API version 0.3, written out by hand; [`v0_5`] adds what
//! API 0.5 (jaxlib 0.12) renamed, grew and added, and its collectives extension.
//!
//! Every struct, enum and function type of the header is mirrored here with its C name. Enums are
//! `#[repr(transparent)]` wrappers around the C `int` rather than Rust enums: XLA may hand us a
//! value this mirror does not know (a newer dtype, say), and a Rust enum holding an unknown
//! discriminant would be undefined behaviour.
//!
//! Structs are declared through `c_struct!`, which also records each field's offset and size and
//! the header's `*_STRUCT_SIZE` value. A test compiles a C program against the header that ships
//! with jaxlib and compares every one of those numbers with this file, so a jaxlib that moves a
//! field fails the tests instead of corrupting memory: this module against every header (a newer
//! one for what the two share), [`v0_5`] exactly against a 0.5 header.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
// The mirror keeps the header's names, and the header documents each of them: repeating its
// comments on every field here would be a second copy to keep in step, so only what this
// mirror adds (its layout records, its version) is documented.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_void};
use std::marker::{PhantomData, PhantomPinned};

/// Major version of the API this mirror was written against (`XLA_FFI_API_MAJOR`).
pub const XLA_FFI_API_MAJOR: c_int = 0;
/// Minor version of the API this mirror was written against (`XLA_FFI_API_MINOR`).
pub const XLA_FFI_API_MINOR: c_int = 3;

/// One field of a mirrored struct, as the layout test sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldLayout {
    pub name: &'static str,
    pub offset: usize,
    pub size: usize,
}

/// Layout facts of one mirrored struct.
#[derive(Debug, Clone, Copy)]
pub struct StructLayout {
    pub name: &'static str,
    pub size: usize,
    /// `*_STRUCT_SIZE` in the header: the offset of the last field named in
    /// `XLA_FFI_DEFINE_STRUCT_TRAITS` plus its size. `None` for structs without traits.
    pub struct_size: Option<usize>,
    pub fields: &'static [FieldLayout],
}

impl StructLayout {
    /// The same layout under another name: a struct a newer header renamed.
    pub const fn renamed(self, name: &'static str) -> StructLayout {
        StructLayout { name, ..self }
    }
}

/// Fields that hold an older or shorter struct whose layout a newer one starts with (API 0.5's
/// grown structs, [`v0_5`]): the layout test checks such a field against the header's fields
/// before the next one, instead of by name.
pub const PREFIX_FIELDS: &[&str] = &["v0_3", "request"];

/// The size of the value a raw pointer points to, usable in `const` items.
const fn size_of_pointee<T>(_: *const T) -> usize {
    std::mem::size_of::<T>()
}

macro_rules! field_layout {
    ($name:ident, $field:ident) => {{
        let probe = std::mem::MaybeUninit::<$name>::uninit();
        let base = probe.as_ptr();
        FieldLayout {
            name: stringify!($field),
            offset: std::mem::offset_of!($name, $field),
            // SAFETY: `addr_of!` only computes the field's address inside `probe`; nothing is
            // read, so the uninitialised contents are never observed.
            size: size_of_pointee(unsafe { std::ptr::addr_of!((*base).$field) }),
        }
    }};
}

/// Declares a `#[repr(C)]` struct and records its layout. `last = field` names the field given to
/// `XLA_FFI_DEFINE_STRUCT_TRAITS` in the header, which defines `STRUCT_SIZE`.
macro_rules! c_struct {
    (
        $(#[$meta:meta])*
        pub struct $name:ident { $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty ),* $(,)? }
        $( last = $last:ident )?
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy)]
        pub struct $name { $( $(#[$fmeta])* pub $field : $ty ),* }

        impl $name {
            /// Field offsets and sizes, for the layout test.
            pub const FIELDS: &'static [FieldLayout] = &[ $( field_layout!($name, $field) ),* ];
            $(
            /// The value of the header's `*_STRUCT_SIZE` for this struct.
            pub const STRUCT_SIZE: usize = {
                let last = field_layout!($name, $last);
                last.offset + last.size
            };
            )?
            /// The layout facts of this struct.
            pub const LAYOUT: StructLayout = StructLayout {
                name: stringify!($name),
                size: std::mem::size_of::<$name>(),
                struct_size: c_struct!(@struct_size $name $($last)?),
                fields: Self::FIELDS,
            };
        }
    };
    (@struct_size $name:ident $last:ident) => { Some($name::STRUCT_SIZE) };
    (@struct_size $name:ident) => { None };
}

macro_rules! c_enum {
    ($(#[$meta:meta])* $name:ident { $($variant:ident = $value:expr),* $(,)? }) => {
        c_enum!(@def $(#[$meta])* $name, stringify!($name), { $($variant = $value),* });
    };
    // `prefix` names the C prefix of the values when it differs from the type's name.
    ($(#[$meta:meta])* $name:ident prefix $prefix:literal, { $($variant:ident = $value:expr),* $(,)? }) => {
        c_enum!(@def $(#[$meta])* $name, $prefix, { $($variant = $value),* });
    };
    (@def $(#[$meta:meta])* $name:ident, $prefix:expr, { $($variant:ident = $value:expr),* }) => {
        $(#[$meta])*
        #[repr(transparent)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(pub c_int);
        impl $name {
            $( pub const $variant: $name = $name($value); )*
            /// Every value the header defines, with its C name (for the layout test).
            pub const VALUES: &'static [(&'static str, c_int)] =
                &[ $( (concat!($prefix, "_", stringify!($variant)), $value) ),* ];
        }
    };
}

macro_rules! opaque {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[repr(C)]
        pub struct $name {
            _private: [u8; 0],
            _marker: PhantomData<(*mut u8, PhantomPinned)>,
        }
    };
}

opaque!(
    /// The XLA runtime's private half of the API table.
    XLA_FFI_InternalApi
);
opaque!(
    /// An error owned by whoever holds the pointer (see the header's ownership rules).
    XLA_FFI_Error
);
opaque!(
    /// Per-invocation execution context.
    XLA_FFI_ExecutionContext
);
opaque!(
    /// Completion signal of an asynchronous handler.
    XLA_FFI_Future
);

// ---------------------------------------------------------------------------------------------
// Extensions
// ---------------------------------------------------------------------------------------------

c_enum!(XLA_FFI_Extension_Type prefix "XLA_FFI_Extension", { Metadata = 1 });

c_struct! {
    pub struct XLA_FFI_Extension_Base {
        pub struct_size: usize,
        pub r#type: XLA_FFI_Extension_Type,
        pub next: *mut XLA_FFI_Extension_Base,
    }
    last = next
}

// ---------------------------------------------------------------------------------------------
// Version
// ---------------------------------------------------------------------------------------------

c_struct! {
    pub struct XLA_FFI_Api_Version {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub major_version: c_int,
        pub minor_version: c_int,
    }
    last = minor_version
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

c_enum!(XLA_FFI_Error_Code {
    OK = 0,
    CANCELLED = 1,
    UNKNOWN = 2,
    INVALID_ARGUMENT = 3,
    DEADLINE_EXCEEDED = 4,
    NOT_FOUND = 5,
    ALREADY_EXISTS = 6,
    PERMISSION_DENIED = 7,
    RESOURCE_EXHAUSTED = 8,
    FAILED_PRECONDITION = 9,
    ABORTED = 10,
    OUT_OF_RANGE = 11,
    UNIMPLEMENTED = 12,
    INTERNAL = 13,
    UNAVAILABLE = 14,
    DATA_LOSS = 15,
    UNAUTHENTICATED = 16,
});

c_struct! {
    pub struct XLA_FFI_Error_Create_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub message: *const c_char,
        pub errc: XLA_FFI_Error_Code,
    }
    last = errc
}
pub type XLA_FFI_Error_Create =
    unsafe extern "C" fn(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_Error_GetMessage_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub error: *mut XLA_FFI_Error,
        pub message: *const c_char,
    }
    last = message
}
pub type XLA_FFI_Error_GetMessage = unsafe extern "C" fn(args: *mut XLA_FFI_Error_GetMessage_Args);

c_struct! {
    pub struct XLA_FFI_Error_Destroy_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub error: *mut XLA_FFI_Error,
    }
    last = error
}
pub type XLA_FFI_Error_Destroy = unsafe extern "C" fn(args: *mut XLA_FFI_Error_Destroy_Args);

// ---------------------------------------------------------------------------------------------
// Data types
// ---------------------------------------------------------------------------------------------

c_enum!(XLA_FFI_DataType {
    INVALID = 0,
    PRED = 1,
    S1 = 30,
    S2 = 26,
    S4 = 21,
    S8 = 2,
    S16 = 3,
    S32 = 4,
    S64 = 5,
    U1 = 31,
    U2 = 27,
    U4 = 22,
    U8 = 6,
    U16 = 7,
    U32 = 8,
    U64 = 9,
    F16 = 10,
    F32 = 11,
    F64 = 12,
    BF16 = 16,
    C64 = 15,
    C128 = 18,
    TOKEN = 17,
    F8E5M2 = 19,
    F8E3M4 = 29,
    F8E4M3 = 28,
    F8E4M3FN = 20,
    F8E4M3B11FNUZ = 23,
    F8E5M2FNUZ = 24,
    F8E4M3FNUZ = 25,
    F4E2M1FN = 32,
    F8E8M0FNU = 33,
});

// ---------------------------------------------------------------------------------------------
// Builtin argument, result and attribute types
// ---------------------------------------------------------------------------------------------

c_struct! {
    pub struct XLA_FFI_Buffer {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub dtype: XLA_FFI_DataType,
        pub data: *mut c_void,
        pub rank: i64,
        pub dims: *mut i64,
    }
    last = dims
}

c_enum!(XLA_FFI_ArgType { BUFFER = 1 });
c_enum!(XLA_FFI_RetType { BUFFER = 1 });
c_enum!(XLA_FFI_AttrType {
    ARRAY = 1,
    DICTIONARY = 2,
    SCALAR = 3,
    STRING = 4,
});

// ---------------------------------------------------------------------------------------------
// Primitives
// ---------------------------------------------------------------------------------------------

c_struct! {
    /// A string that need not be NUL-terminated.
    pub struct XLA_FFI_ByteSpan {
        pub ptr: *const c_char,
        pub len: usize,
    }
}

c_struct! {
    pub struct XLA_FFI_Scalar {
        pub dtype: XLA_FFI_DataType,
        pub value: *mut c_void,
    }
}

c_struct! {
    pub struct XLA_FFI_Array {
        pub dtype: XLA_FFI_DataType,
        pub size: usize,
        pub data: *mut c_void,
    }
}

// ---------------------------------------------------------------------------------------------
// Type registry
// ---------------------------------------------------------------------------------------------

c_struct! {
    pub struct XLA_FFI_TypeId {
        pub type_id: i64,
    }
}

/// `XLA_FFI_UNKNOWN_TYPE_ID`.
pub const XLA_FFI_UNKNOWN_TYPE_ID: XLA_FFI_TypeId = XLA_FFI_TypeId { type_id: 0 };

c_struct! {
    pub struct XLA_FFI_TypeInfo {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub deleter: Option<unsafe extern "C" fn(object: *mut c_void)>,
    }
    last = deleter
}

// ---------------------------------------------------------------------------------------------
// Futures
// ---------------------------------------------------------------------------------------------

c_struct! {
    pub struct XLA_FFI_Future_Create_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub future: *mut XLA_FFI_Future,
    }
    // Sic: the header names `extension_start` here, not `future`.
    last = extension_start
}
pub type XLA_FFI_Future_Create =
    unsafe extern "C" fn(args: *mut XLA_FFI_Future_Create_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_Future_SetAvailable_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub future: *mut XLA_FFI_Future,
    }
    last = future
}
pub type XLA_FFI_Future_SetAvailable =
    unsafe extern "C" fn(args: *mut XLA_FFI_Future_SetAvailable_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_Future_SetError_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub future: *mut XLA_FFI_Future,
        pub error: *mut XLA_FFI_Error,
    }
    last = error
}
pub type XLA_FFI_Future_SetError =
    unsafe extern "C" fn(args: *mut XLA_FFI_Future_SetError_Args) -> *mut XLA_FFI_Error;

// ---------------------------------------------------------------------------------------------
// Call frame
// ---------------------------------------------------------------------------------------------

c_enum!(XLA_FFI_ExecutionStage {
    INSTANTIATE = 0,
    PREPARE = 1,
    INITIALIZE = 2,
    EXECUTE = 3,
});

c_struct! {
    pub struct XLA_FFI_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub size: i64,
        pub types: *mut XLA_FFI_ArgType,
        pub args: *mut *mut c_void,
    }
    last = args
}

c_struct! {
    pub struct XLA_FFI_Rets {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub size: i64,
        pub types: *mut XLA_FFI_RetType,
        pub rets: *mut *mut c_void,
    }
    last = rets
}

c_struct! {
    /// Attributes, always sorted by name.
    pub struct XLA_FFI_Attrs {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub size: i64,
        pub types: *mut XLA_FFI_AttrType,
        pub names: *mut *mut XLA_FFI_ByteSpan,
        pub attrs: *mut *mut c_void,
    }
    last = attrs
}

c_struct! {
    pub struct XLA_FFI_CallFrame {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub api: *const XLA_FFI_Api,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub stage: XLA_FFI_ExecutionStage,
        pub args: XLA_FFI_Args,
        pub rets: XLA_FFI_Rets,
        pub attrs: XLA_FFI_Attrs,
        pub future: *mut XLA_FFI_Future,
    }
    last = attrs
}

// ---------------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------------

pub type XLA_FFI_Handler =
    unsafe extern "C" fn(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_Handler_Bundle {
        pub instantiate: Option<XLA_FFI_Handler>,
        pub prepare: Option<XLA_FFI_Handler>,
        pub initialize: Option<XLA_FFI_Handler>,
        pub execute: Option<XLA_FFI_Handler>,
    }
}

/// `XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE`.
pub const XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE: u32 = 1 << 0;
pub type XLA_FFI_Handler_Traits = u32;

c_struct! {
    pub struct XLA_FFI_Handler_Register_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub name: XLA_FFI_ByteSpan,
        pub platform: XLA_FFI_ByteSpan,
        pub bundle: XLA_FFI_Handler_Bundle,
        pub traits: XLA_FFI_Handler_Traits,
    }
    last = traits
}
pub type XLA_FFI_Handler_Register =
    unsafe extern "C" fn(args: *mut XLA_FFI_Handler_Register_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_Type_Register_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub name: XLA_FFI_ByteSpan,
        pub type_id: *mut XLA_FFI_TypeId,
        pub type_info: *const XLA_FFI_TypeInfo,
    }
    // Sic: the header names `type_id` here, not `type_info`.
    last = type_id
}
pub type XLA_FFI_Type_Register =
    unsafe extern "C" fn(args: *mut XLA_FFI_Type_Register_Args) -> *mut XLA_FFI_Error;

// ---------------------------------------------------------------------------------------------
// Execution context
// ---------------------------------------------------------------------------------------------

c_struct! {
    pub struct XLA_FFI_ExecutionContext_Get_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub type_id: *mut XLA_FFI_TypeId,
        pub data: *mut c_void,
    }
    last = data
}
pub type XLA_FFI_ExecutionContext_Get =
    unsafe extern "C" fn(args: *mut XLA_FFI_ExecutionContext_Get_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_State_Set_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub stage: XLA_FFI_ExecutionStage,
        pub type_id: *mut XLA_FFI_TypeId,
        pub state: *mut c_void,
    }
    last = state
}
pub type XLA_FFI_State_Set =
    unsafe extern "C" fn(args: *mut XLA_FFI_State_Set_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_State_Get_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub stage: XLA_FFI_ExecutionStage,
        pub type_id: *mut XLA_FFI_TypeId,
        pub state: *mut c_void,
    }
    last = state
}
pub type XLA_FFI_State_Get =
    unsafe extern "C" fn(args: *mut XLA_FFI_State_Get_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_Stream_Get_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub stream: *mut c_void,
    }
    last = stream
}
pub type XLA_FFI_Stream_Get =
    unsafe extern "C" fn(args: *mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_DeviceMemory_Allocate_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub size: usize,
        pub alignment: usize,
        pub data: *mut c_void,
    }
    last = data
}
pub type XLA_FFI_DeviceMemory_Allocate =
    unsafe extern "C" fn(args: *mut XLA_FFI_DeviceMemory_Allocate_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_DeviceMemory_Free_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub size: usize,
        pub data: *mut c_void,
    }
    last = data
}
pub type XLA_FFI_DeviceMemory_Free =
    unsafe extern "C" fn(args: *mut XLA_FFI_DeviceMemory_Free_Args) -> *mut XLA_FFI_Error;

pub type XLA_FFI_Task = unsafe extern "C" fn(data: *mut c_void);

c_struct! {
    pub struct XLA_FFI_ThreadPool_Schedule_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub task: Option<XLA_FFI_Task>,
        pub data: *mut c_void,
    }
    last = data
}
pub type XLA_FFI_ThreadPool_Schedule =
    unsafe extern "C" fn(args: *mut XLA_FFI_ThreadPool_Schedule_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_ThreadPool_NumThreads_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub num_threads: *mut i64,
    }
    last = num_threads
}
pub type XLA_FFI_ThreadPool_NumThreads =
    unsafe extern "C" fn(args: *mut XLA_FFI_ThreadPool_NumThreads_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_RunId_Get_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub run_id: i64,
    }
    last = run_id
}
pub type XLA_FFI_RunId_Get =
    unsafe extern "C" fn(args: *mut XLA_FFI_RunId_Get_Args) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_DeviceOrdinal_Get_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub ctx: *mut XLA_FFI_ExecutionContext,
        pub device_ordinal: i32,
    }
    last = device_ordinal
}
pub type XLA_FFI_DeviceOrdinal_Get =
    unsafe extern "C" fn(args: *mut XLA_FFI_DeviceOrdinal_Get_Args) -> *mut XLA_FFI_Error;

// ---------------------------------------------------------------------------------------------
// Metadata extension
// ---------------------------------------------------------------------------------------------

c_struct! {
    pub struct XLA_FFI_Metadata {
        pub struct_size: usize,
        pub api_version: XLA_FFI_Api_Version,
        pub traits: XLA_FFI_Handler_Traits,
        pub state_type_id: XLA_FFI_TypeId,
    }
    // Sic: `state_type_id` was added after `traits` without moving the struct traits.
    last = traits
}

c_struct! {
    pub struct XLA_FFI_Metadata_Extension {
        pub extension_base: XLA_FFI_Extension_Base,
        pub metadata: *mut XLA_FFI_Metadata,
    }
    last = metadata
}

// ---------------------------------------------------------------------------------------------
// The API table
// ---------------------------------------------------------------------------------------------

c_struct! {
    pub struct XLA_FFI_Api {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_Extension_Base,
        pub api_version: XLA_FFI_Api_Version,
        pub internal_api: *const XLA_FFI_InternalApi,
        pub XLA_FFI_Error_Create: Option<XLA_FFI_Error_Create>,
        pub XLA_FFI_Error_GetMessage: Option<XLA_FFI_Error_GetMessage>,
        pub XLA_FFI_Error_Destroy: Option<XLA_FFI_Error_Destroy>,
        pub XLA_FFI_Handler_Register: Option<XLA_FFI_Handler_Register>,
        pub XLA_FFI_Stream_Get: Option<XLA_FFI_Stream_Get>,
        pub XLA_FFI_Type_Register: Option<XLA_FFI_Type_Register>,
        pub XLA_FFI_ExecutionContext_Get: Option<XLA_FFI_ExecutionContext_Get>,
        pub XLA_FFI_State_Set: Option<XLA_FFI_State_Set>,
        pub XLA_FFI_State_Get: Option<XLA_FFI_State_Get>,
        pub XLA_FFI_DeviceMemory_Allocate: Option<XLA_FFI_DeviceMemory_Allocate>,
        pub XLA_FFI_DeviceMemory_Free: Option<XLA_FFI_DeviceMemory_Free>,
        pub XLA_FFI_ThreadPool_Schedule: Option<XLA_FFI_ThreadPool_Schedule>,
        pub XLA_FFI_ThreadPool_NumThreads: Option<XLA_FFI_ThreadPool_NumThreads>,
        pub XLA_FFI_Future_Create: Option<XLA_FFI_Future_Create>,
        pub XLA_FFI_Future_SetAvailable: Option<XLA_FFI_Future_SetAvailable>,
        pub XLA_FFI_Future_SetError: Option<XLA_FFI_Future_SetError>,
        pub XLA_FFI_RunId_Get: Option<XLA_FFI_RunId_Get>,
        pub XLA_FFI_DeviceOrdinal_Get: Option<XLA_FFI_DeviceOrdinal_Get>,
    }
    last = XLA_FFI_DeviceOrdinal_Get
}

/// Every mirrored struct, for the layout test.
pub const ALL_STRUCTS: &[StructLayout] = &[
    XLA_FFI_Extension_Base::LAYOUT,
    XLA_FFI_Api_Version::LAYOUT,
    XLA_FFI_Error_Create_Args::LAYOUT,
    XLA_FFI_Error_GetMessage_Args::LAYOUT,
    XLA_FFI_Error_Destroy_Args::LAYOUT,
    XLA_FFI_Buffer::LAYOUT,
    XLA_FFI_ByteSpan::LAYOUT,
    XLA_FFI_Scalar::LAYOUT,
    XLA_FFI_Array::LAYOUT,
    XLA_FFI_TypeId::LAYOUT,
    XLA_FFI_TypeInfo::LAYOUT,
    XLA_FFI_Future_Create_Args::LAYOUT,
    XLA_FFI_Future_SetAvailable_Args::LAYOUT,
    XLA_FFI_Future_SetError_Args::LAYOUT,
    XLA_FFI_Args::LAYOUT,
    XLA_FFI_Rets::LAYOUT,
    XLA_FFI_Attrs::LAYOUT,
    XLA_FFI_CallFrame::LAYOUT,
    XLA_FFI_Handler_Bundle::LAYOUT,
    XLA_FFI_Handler_Register_Args::LAYOUT,
    XLA_FFI_Type_Register_Args::LAYOUT,
    XLA_FFI_ExecutionContext_Get_Args::LAYOUT,
    XLA_FFI_State_Set_Args::LAYOUT,
    XLA_FFI_State_Get_Args::LAYOUT,
    XLA_FFI_Stream_Get_Args::LAYOUT,
    XLA_FFI_DeviceMemory_Allocate_Args::LAYOUT,
    XLA_FFI_DeviceMemory_Free_Args::LAYOUT,
    XLA_FFI_ThreadPool_Schedule_Args::LAYOUT,
    XLA_FFI_ThreadPool_NumThreads_Args::LAYOUT,
    XLA_FFI_RunId_Get_Args::LAYOUT,
    XLA_FFI_DeviceOrdinal_Get_Args::LAYOUT,
    XLA_FFI_Metadata::LAYOUT,
    XLA_FFI_Metadata_Extension::LAYOUT,
    XLA_FFI_Api::LAYOUT,
];

/// Every mirrored enum's values, for the layout test.
pub const ALL_ENUM_VALUES: &[&[(&str, c_int)]] = &[
    XLA_FFI_Extension_Type::VALUES,
    XLA_FFI_Error_Code::VALUES,
    XLA_FFI_DataType::VALUES,
    XLA_FFI_ArgType::VALUES,
    XLA_FFI_RetType::VALUES,
    XLA_FFI_AttrType::VALUES,
    XLA_FFI_ExecutionStage::VALUES,
];

pub mod v0_5;
