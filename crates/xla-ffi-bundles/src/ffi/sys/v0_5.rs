//! What API 0.5 (`c_api.h` of jaxlib 0.12) renamed, grew and added over the 0.3 mirror in
//! [`super`], and the collectives extension of `collectives_c_api.h` that 0.5 runtimes may attach.
//!
//! 0.5 keeps every 0.3 layout: it renames (`XLA_FFI_InternalExtension`, `XLA_FFI_InvokeContext`,
//! `XLA_FFI_Error_GetDetails`), and grows three structs at their end (`XLA_FFI_Api` by
//! `XLA_FFI_InvokeContext_FindExtension` and `XLA_FFI_CustomOptions_Get`,
//! `XLA_FFI_Error_GetDetails_Args` by `errc`, `XLA_FFI_Handler_Bundle` by `record`). A grown
//! struct is written here as its 0.3 self in a field `v0_3` followed by what 0.5 appended, so
//! the mirror says in its types that a 0.5 table read as a 0.3 one is the 0.3 table, and a
//! pointer to either is a pointer to the other's prefix. The layout test compiles these against
//! the 0.5 headers and checks every size, `*_STRUCT_SIZE`, field and enum value exactly (a
//! `v0_3` field: at offset 0, as long as the header's fields before the first appended one).
//!
//! What a handler may use of this depends on the runtime it runs in: the crate reads the
//! version and the `struct_size` of the table it is handed and calls a 0.5 function only
//! where the table has it (`api_fn!`).

use std::ffi::{c_int, c_void};
use std::marker::{PhantomData, PhantomPinned};

use super::{
    size_of_pointee, FieldLayout, StructLayout, XLA_FFI_Attrs, XLA_FFI_Error, XLA_FFI_Error_Code,
    XLA_FFI_ExecutionContext, XLA_FFI_ExecutionStage, XLA_FFI_Extension_Base, XLA_FFI_Handler,
};

/// Minor version of API 0.5 (`XLA_FFI_API_MINOR` of its header).
pub const XLA_FFI_API_MINOR: c_int = 5;

/// 0.5's name of [`XLA_FFI_Extension_Base`], the chain of XLA's own extensions (the metadata
/// extension) in call frames and argument structs. Same layout.
pub type XLA_FFI_InternalExtension = XLA_FFI_Extension_Base;
/// 0.5's name of the execution context (the header keeps the old one as an alias).
pub type XLA_FFI_InvokeContext = XLA_FFI_ExecutionContext;
/// 0.5's name of `XLA_FFI_ExecutionContext_Get_Args` (user data by type id). Same layout.
pub type XLA_FFI_InvokeContext_Get_Args = super::XLA_FFI_ExecutionContext_Get_Args;

/// `XLA_FFI_ExecutionStage_RECORD`: a stage 0.5 added, for handlers that record commands
/// (kernel launches, copies) into a command buffer through the record extension (128) instead
/// of running them.
pub const XLA_FFI_ExecutionStage_RECORD: XLA_FFI_ExecutionStage = XLA_FFI_ExecutionStage(4);

// ---------------------------------------------------------------------------------------------
// Extensions attached to an invoke context
// ---------------------------------------------------------------------------------------------

c_struct! {
    pub struct XLA_FFI_ExtensionId {
        pub extension_type: i64,
        pub major_version: i32,
        pub minor_version: i32,
    }
    last = minor_version
}

c_struct! {
    /// The head of every extension a runtime attaches to an invoke context.
    pub struct XLA_FFI_Extension {
        pub struct_size: usize,
        pub id: XLA_FFI_ExtensionId,
        pub next: *const XLA_FFI_Extension,
    }
    last = next
}

c_struct! {
    pub struct XLA_FFI_InvokeContext_FindExtension_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_InternalExtension,
        pub ctx: *mut XLA_FFI_InvokeContext,
        pub extension_type: i64,
        pub extension: *const XLA_FFI_Extension,
    }
    last = extension
}
pub type XLA_FFI_InvokeContext_FindExtension =
    unsafe extern "C" fn(args: *mut XLA_FFI_InvokeContext_FindExtension_Args) -> *mut XLA_FFI_Error;

// ---------------------------------------------------------------------------------------------
// Errors, custom options
// ---------------------------------------------------------------------------------------------

c_struct! {
    /// `XLA_FFI_Error_GetMessage_Args` and the error's code (0.5 writes it only when the
    /// declared `struct_size` covers it).
    pub struct XLA_FFI_Error_GetDetails_Args {
        pub v0_3: super::XLA_FFI_Error_GetMessage_Args,
        pub errc: XLA_FFI_Error_Code,
    }
    last = errc
}
pub type XLA_FFI_Error_GetDetails = unsafe extern "C" fn(args: *mut XLA_FFI_Error_GetDetails_Args);

c_struct! {
    pub struct XLA_FFI_CustomOptions_Get_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_InternalExtension,
        pub ctx: *mut XLA_FFI_InvokeContext,
        pub attrs: *const XLA_FFI_Attrs,
    }
    last = attrs
}
pub type XLA_FFI_CustomOptions_Get =
    unsafe extern "C" fn(args: *mut XLA_FFI_CustomOptions_Get_Args) -> *mut XLA_FFI_Error;

// ---------------------------------------------------------------------------------------------
// Handlers and the API table
// ---------------------------------------------------------------------------------------------

c_struct! {
    /// The four 0.3 stages and `record`.
    pub struct XLA_FFI_Handler_Bundle {
        pub v0_3: super::XLA_FFI_Handler_Bundle,
        pub record: Option<XLA_FFI_Handler>,
    }
}

c_struct! {
    /// The 0.3 table (its `XLA_FFI_Error_GetMessage` is 0.5's `XLA_FFI_Error_GetDetails`, its
    /// `XLA_FFI_ExecutionContext_Get` 0.5's `XLA_FFI_InvokeContext_Get`) and two functions.
    pub struct XLA_FFI_Api {
        pub v0_3: super::XLA_FFI_Api,
        pub XLA_FFI_InvokeContext_FindExtension: Option<XLA_FFI_InvokeContext_FindExtension>,
        pub XLA_FFI_CustomOptions_Get: Option<XLA_FFI_CustomOptions_Get>,
    }
    last = XLA_FFI_CustomOptions_Get
}

// ---------------------------------------------------------------------------------------------
// The collectives extension (`collectives_c_api.h`)
// ---------------------------------------------------------------------------------------------

/// `XLA_FFI_Extension_Collectives`: the extension type of [`XLA_FFI_Collectives_Extension`].
pub const XLA_FFI_Extension_Collectives: i64 = 129;
/// `XLA_FFI_Extension_Collectives_MajorVersion`.
pub const XLA_FFI_Extension_Collectives_MajorVersion: i32 = 0;
/// `XLA_FFI_Extension_Collectives_MinorVersion`.
pub const XLA_FFI_Extension_Collectives_MinorVersion: i32 = 2;

c_enum!(XLA_FFI_CollectiveGroupMode prefix "XLA_FFI_GROUP", {
    CROSS_REPLICA = 0,
    CROSS_PARTITION = 1,
    CROSS_REPLICA_AND_PARTITION = 2,
    FLATTENED_ID = 3,
});

opaque!(
    /// The runtime's per-invocation collective state, read only by the extension's functions.
    XLA_FFI_CollectivesState
);
opaque!(
    /// A backend's communicator (`ncclComm_t` on XLA:GPU), not owned by the handler.
    XLA_FFI_Communicator
);
opaque!(
    /// A backend's collective memory window (`ncclWindow_t` on XLA:GPU).
    XLA_FFI_Window
);

c_struct! {
    pub struct XLA_FFI_ReplicaGroup {
        pub ids: *const i64,
        pub size: usize,
    }
}

c_struct! {
    pub struct XLA_FFI_Communicator_Request_Args {
        pub struct_size: usize,
        pub extension_start: *mut XLA_FFI_InternalExtension,
        pub group_mode: XLA_FFI_CollectiveGroupMode,
        pub groups: *const XLA_FFI_ReplicaGroup,
        pub num_groups: usize,
        pub communication_id: i64,
    }
    last = communication_id
}
pub type XLA_FFI_Communicator_Request = unsafe extern "C" fn(
    this: *const XLA_FFI_Collectives_Extension,
    args: *mut XLA_FFI_Communicator_Request_Args,
) -> *mut XLA_FFI_Error;

c_struct! {
    /// The request's fields and the communicator the runtime hands back.
    pub struct XLA_FFI_Communicator_Get_Args {
        pub request: XLA_FFI_Communicator_Request_Args,
        pub communicator: *mut XLA_FFI_Communicator,
    }
    last = communicator
}
pub type XLA_FFI_Communicator_Get = unsafe extern "C" fn(
    this: *const XLA_FFI_Collectives_Extension,
    args: *mut XLA_FFI_Communicator_Get_Args,
) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_CollectiveMemoryRegion {
        pub buffer: *const c_void,
        pub byte_size: usize,
        pub flags: u64,
    }
}

c_struct! {
    pub struct XLA_FFI_Window_Request_Args {
        pub request: XLA_FFI_Communicator_Request_Args,
        pub regions: *const XLA_FFI_CollectiveMemoryRegion,
        pub num_regions: usize,
    }
    last = num_regions
}
pub type XLA_FFI_Window_Request = unsafe extern "C" fn(
    this: *const XLA_FFI_Collectives_Extension,
    args: *mut XLA_FFI_Window_Request_Args,
) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_Window_Get_Args {
        pub request: XLA_FFI_Communicator_Request_Args,
        pub buffer: *const c_void,
        pub window: *mut XLA_FFI_Window,
        pub window_offset: usize,
    }
    last = window_offset
}
pub type XLA_FFI_Window_Get = unsafe extern "C" fn(
    this: *const XLA_FFI_Collectives_Extension,
    args: *mut XLA_FFI_Window_Get_Args,
) -> *mut XLA_FFI_Error;

c_struct! {
    pub struct XLA_FFI_Collectives_Extension {
        pub extension_base: XLA_FFI_Extension,
        pub state: *mut XLA_FFI_CollectivesState,
        pub request_communicator: Option<XLA_FFI_Communicator_Request>,
        pub get_communicator: Option<XLA_FFI_Communicator_Get>,
        pub request_window: Option<XLA_FFI_Window_Request>,
        pub get_window: Option<XLA_FFI_Window_Get>,
    }
    last = get_window
}

/// Every struct of API 0.5 this crate mirrors, under 0.5's names, for the layout test: the 0.3
/// structs 0.5 left alone, those it renamed, grew or added, and the collectives extension's.
/// (`XLA_FFI_Handler_Register_Args` is left out: the crate never registers handlers itself.)
pub const ALL_STRUCTS: &[StructLayout] = &[
    XLA_FFI_Extension_Base::LAYOUT.renamed("XLA_FFI_InternalExtension"),
    XLA_FFI_ExtensionId::LAYOUT,
    XLA_FFI_Extension::LAYOUT,
    super::XLA_FFI_Api_Version::LAYOUT,
    super::XLA_FFI_Error_Create_Args::LAYOUT,
    XLA_FFI_Error_GetDetails_Args::LAYOUT,
    super::XLA_FFI_Error_Destroy_Args::LAYOUT,
    super::XLA_FFI_Buffer::LAYOUT,
    super::XLA_FFI_ByteSpan::LAYOUT,
    super::XLA_FFI_Scalar::LAYOUT,
    super::XLA_FFI_Array::LAYOUT,
    super::XLA_FFI_TypeId::LAYOUT,
    super::XLA_FFI_TypeInfo::LAYOUT,
    super::XLA_FFI_Future_Create_Args::LAYOUT,
    super::XLA_FFI_Future_SetAvailable_Args::LAYOUT,
    super::XLA_FFI_Future_SetError_Args::LAYOUT,
    super::XLA_FFI_Args::LAYOUT,
    super::XLA_FFI_Rets::LAYOUT,
    super::XLA_FFI_Attrs::LAYOUT,
    super::XLA_FFI_CallFrame::LAYOUT,
    XLA_FFI_Handler_Bundle::LAYOUT,
    super::XLA_FFI_Type_Register_Args::LAYOUT,
    XLA_FFI_InvokeContext_FindExtension_Args::LAYOUT,
    super::XLA_FFI_ExecutionContext_Get_Args::LAYOUT.renamed("XLA_FFI_InvokeContext_Get_Args"),
    XLA_FFI_CustomOptions_Get_Args::LAYOUT,
    super::XLA_FFI_State_Set_Args::LAYOUT,
    super::XLA_FFI_State_Get_Args::LAYOUT,
    super::XLA_FFI_Stream_Get_Args::LAYOUT,
    super::XLA_FFI_DeviceMemory_Allocate_Args::LAYOUT,
    super::XLA_FFI_DeviceMemory_Free_Args::LAYOUT,
    super::XLA_FFI_ThreadPool_Schedule_Args::LAYOUT,
    super::XLA_FFI_ThreadPool_NumThreads_Args::LAYOUT,
    super::XLA_FFI_RunId_Get_Args::LAYOUT,
    super::XLA_FFI_DeviceOrdinal_Get_Args::LAYOUT,
    super::XLA_FFI_Metadata::LAYOUT,
    super::XLA_FFI_Metadata_Extension::LAYOUT,
    XLA_FFI_Api::LAYOUT,
    XLA_FFI_ReplicaGroup::LAYOUT,
    XLA_FFI_Communicator_Request_Args::LAYOUT,
    XLA_FFI_Communicator_Get_Args::LAYOUT,
    XLA_FFI_CollectiveMemoryRegion::LAYOUT,
    XLA_FFI_Window_Request_Args::LAYOUT,
    XLA_FFI_Window_Get_Args::LAYOUT,
    XLA_FFI_Collectives_Extension::LAYOUT,
];

/// The struct each `v0_3` or `request` field ([`super::PREFIX_FIELDS`]) holds, by the name of the
/// struct that holds it: the layout test checks its fields where the header puts them.
pub const PREFIXES: &[(&str, StructLayout)] = &[
    (
        "XLA_FFI_Error_GetDetails_Args",
        super::XLA_FFI_Error_GetMessage_Args::LAYOUT,
    ),
    (
        "XLA_FFI_Handler_Bundle",
        super::XLA_FFI_Handler_Bundle::LAYOUT,
    ),
    ("XLA_FFI_Api", super::XLA_FFI_Api::LAYOUT),
    (
        "XLA_FFI_Communicator_Get_Args",
        XLA_FFI_Communicator_Request_Args::LAYOUT,
    ),
    (
        "XLA_FFI_Window_Request_Args",
        XLA_FFI_Communicator_Request_Args::LAYOUT,
    ),
    (
        "XLA_FFI_Window_Get_Args",
        XLA_FFI_Communicator_Request_Args::LAYOUT,
    ),
];

/// Every enum value of API 0.5 this crate mirrors, with the header's names.
pub const ALL_ENUM_VALUES: &[&[(&str, c_int)]] = &[
    super::XLA_FFI_Extension_Type::VALUES,
    super::XLA_FFI_Error_Code::VALUES,
    super::XLA_FFI_DataType::VALUES,
    super::XLA_FFI_ArgType::VALUES,
    super::XLA_FFI_RetType::VALUES,
    super::XLA_FFI_AttrType::VALUES,
    super::XLA_FFI_ExecutionStage::VALUES,
    &[(
        "XLA_FFI_ExecutionStage_RECORD",
        XLA_FFI_ExecutionStage_RECORD.0,
    )],
    XLA_FFI_CollectiveGroupMode::VALUES,
];

/// The 64-bit constants of the collectives header, for the layout test.
pub const CONSTANTS: &[(&str, i64)] = &[
    (
        "XLA_FFI_Extension_Collectives",
        XLA_FFI_Extension_Collectives,
    ),
    (
        "XLA_FFI_Extension_Collectives_MajorVersion",
        XLA_FFI_Extension_Collectives_MajorVersion as i64,
    ),
    (
        "XLA_FFI_Extension_Collectives_MinorVersion",
        XLA_FFI_Extension_Collectives_MinorVersion as i64,
    ),
    ("XLA_FFI_API_MINOR", XLA_FFI_API_MINOR as i64),
];
