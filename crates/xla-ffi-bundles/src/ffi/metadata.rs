//! The metadata answer: XLA calls every handler once at registration with an
//! `XLA_FFI_Metadata_Extension` and no operands, and the handler must fill in the API version it
//! was built against, its traits and (for a handler that creates state) the state type id.

use std::ptr;

use super::error::{FfiError, FfiResult};
use super::stage::Stage;
use super::sys;
use super::types::StateTypeRegistration;

/// What a handler declares about itself: the metadata XLA asks for (traits, the state type it
/// creates), and its target and stage, which the trampoline puts in every error message.
#[derive(Clone, Copy)]
pub struct HandlerInfo {
    /// The custom-call target name.
    pub target: &'static str,
    /// The stage this handler runs.
    pub stage: Stage,
    /// The handler traits reported to XLA.
    pub traits: sys::XLA_FFI_Handler_Traits,
    /// The state type this handler creates (instantiate stages of stateful bundles).
    pub creates_state: Option<&'static StateTypeRegistration>,
    /// Whether XLA keeps prepare- and initialize-stage state for the bundle's calls (its
    /// platform has them, [`super::platform::Platform::KEEPS_STAGE_STATE`], and it is not
    /// command-buffer compatible); the context refuses those states where it does not.
    pub keeps_stage_state: bool,
}

/// Extension chains longer than this are treated as malformed (XLA sends one).
const MAX_EXTENSIONS: usize = 64;

/// The metadata extension of a frame, if it has one.
///
/// # Safety
/// `frame` must be readable up to `extension_start`, and its extension chain null-terminated
/// with each link readable.
pub(crate) unsafe fn find_extension(
    frame: *const sys::XLA_FFI_CallFrame,
) -> Option<*mut sys::XLA_FFI_Metadata_Extension> {
    // SAFETY: per the contract.
    let mut next = unsafe { ptr::addr_of!((*frame).extension_start).read() };
    for _ in 0..MAX_EXTENSIONS {
        if next.is_null() {
            return None;
        }
        // SAFETY: each link of the chain is a readable `XLA_FFI_Extension_Base`.
        let base = unsafe { next.read() };
        if base.r#type == sys::XLA_FFI_Extension_Type::Metadata {
            return Some(next.cast());
        }
        next = base.next;
    }
    None
}

/// The API minor version a handler reports to a runtime of version `runtime` (major, minor): the
/// newest both speak. A runtime refuses a handler that reports a version newer than its own
/// (jaxlib 0.10.2, API 0.3: "the handler's API version (0.5) is incompatible with the
/// framework's API version (0.3)"), so 0.5 to 0.5 and newer 0.x runtimes, and 0.3 to the rest:
/// older ones, those of unknown version (this crate mirrors no 0.4) and another major version
/// (whose runtime says whether it still takes 0.3).
pub fn reported_minor(runtime: Option<(i32, i32)>) -> i32 {
    match runtime {
        Some((major, minor))
            if major == sys::XLA_FFI_API_MAJOR && minor >= sys::v0_5::XLA_FFI_API_MINOR =>
        {
            sys::v0_5::XLA_FFI_API_MINOR
        }
        _ => sys::XLA_FFI_API_MINOR,
    }
}

/// The API minor version this copy of the crate last reported at registration (0 before any):
/// what a handler of a library can tell a test about its own metadata answers, which XLA keeps
/// to itself.
pub fn last_reported_minor() -> i32 {
    LAST_REPORTED.load(std::sync::atomic::Ordering::Relaxed)
}

static LAST_REPORTED: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// Fills in the metadata for `info`, reporting the API version [`reported_minor`] picks for the
/// `runtime`'s version.
///
/// # Safety
/// `extension` must point to a metadata extension as XLA passes it.
pub(crate) unsafe fn answer(
    extension: *mut sys::XLA_FFI_Metadata_Extension,
    info: &HandlerInfo,
    runtime: Option<(i32, i32)>,
) -> FfiResult<()> {
    // SAFETY: the extension base is readable (found by `find_extension`).
    let ext_size = unsafe { ptr::addr_of!((*extension).extension_base.struct_size).read() };
    if ext_size < sys::XLA_FFI_Metadata_Extension::STRUCT_SIZE {
        return Err(FfiError::invalid_argument(format!(
            "unexpected XLA_FFI_Metadata_Extension size: expected at least {}, got {ext_size}",
            sys::XLA_FFI_Metadata_Extension::STRUCT_SIZE
        )));
    }
    // SAFETY: the extension covers `metadata` (checked above).
    let metadata = unsafe { ptr::addr_of!((*extension).metadata).read() };
    if metadata.is_null() {
        return Err(FfiError::invalid_argument(
            "metadata extension without metadata",
        ));
    }
    // SAFETY: non-null metadata has a readable `struct_size`.
    let size = unsafe { ptr::addr_of!((*metadata).struct_size).read() };
    if size < sys::XLA_FFI_Metadata::STRUCT_SIZE {
        return Err(FfiError::invalid_argument(format!(
            "unexpected XLA_FFI_Metadata size: expected at least {}, got {size}",
            sys::XLA_FFI_Metadata::STRUCT_SIZE
        )));
    }
    let version = sys::XLA_FFI_Api_Version {
        struct_size: sys::XLA_FFI_Api_Version::STRUCT_SIZE,
        extension_start: ptr::null_mut(),
        major_version: sys::XLA_FFI_API_MAJOR,
        minor_version: reported_minor(runtime),
    };
    LAST_REPORTED.store(version.minor_version, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: the metadata covers `api_version` and `traits` (its struct size was checked).
    unsafe {
        ptr::addr_of_mut!((*metadata).api_version).write(version);
        ptr::addr_of_mut!((*metadata).traits).write(info.traits);
    }

    let type_id = match info.creates_state {
        None => 0,
        Some(registration) if registration.type_id() == 0 => {
            return Err(FfiError::failed_precondition(format!(
                "Types used by FFI handlers must be registered before the handler registration: \
                 state type `{}` of this handler has no type id (register it with \
                 jax.ffi.register_ffi_type first)",
                registration.name()
            )));
        }
        Some(registration) => registration.type_id(),
    };
    // The header's struct traits stop at `traits` (the field was added later without moving
    // them), so `struct_size` cannot tell whether `state_type_id` exists. Every runtime that
    // speaks API 0.3 allocates it, and XLA's own C++ binding writes it unconditionally; so do we.
    // SAFETY: the metadata is a whole `XLA_FFI_Metadata` of this API version (see above).
    unsafe { ptr::addr_of_mut!((*metadata).state_type_id).write(sys::XLA_FFI_TypeId { type_id }) };
    Ok(())
}
