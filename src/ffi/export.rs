//! Exporting a bundle from a crate of your own, as plain C data that Python reads with `ctypes`.
//!
//! This extension hands its bundles to Python as PyCapsules (see [`super::capsule`]). A crate
//! that builds its own shared library on top of this one has no Python module to do that, so it
//! exports one `extern "C"` function per bundle, declared with [`crate::export_bundle!`], that
//! returns a [`BundleExport`]: the target name, the stage handlers and the state type's id and
//! info, as raw pointers. Python loads the library with `ctypes`, wraps each pointer with
//! `jax.ffi.pycapsule`, and registers the type and then the target
//! (`examples/counter_bundle/` is the complete example).
//!
//! Everything the pointers point to is `'static`: code, the type info, and the type id cell
//! that XLA writes when the type is registered.

use std::ffi::{c_char, c_void, CString};
use std::ptr;

use super::bundle::BundleDef;

/// A bundle and its state type, as C sees them. Pointers that do not apply are null: a stage
/// the bundle does not have, or the state type of a stateless bundle.
///
/// The layout is part of the contract with the Python side (`ctypes.Structure` with these
/// fields in this order, every field pointer-sized).
#[repr(C)]
#[derive(Debug)]
pub struct BundleExport {
    /// The target name, NUL-terminated.
    pub target: *const c_char,
    /// `XLA_FFI_Handler*` of each stage.
    pub instantiate: *const c_void,
    pub prepare: *const c_void,
    pub initialize: *const c_void,
    pub execute: *const c_void,
    /// The state type's name in XLA's registry, NUL-terminated.
    pub state_type_name: *const c_char,
    /// `XLA_FFI_TypeId*`, which XLA fills in at type registration (the `"type_id"` capsule).
    pub type_id: *mut c_void,
    /// `XLA_FFI_TypeInfo*` with the deleter (the `"type_info"` capsule).
    pub type_info: *const c_void,
}

// SAFETY: every pointer is to immutable `'static` data or code, except `type_id`, which points
// to an atomic cell (`TypeIdCell`) that XLA writes once; the struct itself is never mutated.
unsafe impl Send for BundleExport {}
// SAFETY: as above; shared references only read the pointers.
unsafe impl Sync for BundleExport {}

fn handler_ptr(handler: crate::ffi::sys::XLA_FFI_Handler) -> *const c_void {
    handler as *const c_void
}

/// A name as a NUL-terminated string that lives for the rest of the process (made once per
/// export, so the leak is bounded by the number of exported bundles).
fn leak_c_string(name: &str) -> *const c_char {
    let owned = CString::new(name).expect("bundle and state type names contain no NUL byte");
    Box::leak(owned.into_boxed_c_str()).as_ptr()
}

impl BundleExport {
    /// The C view of `def`. Meant to be built once and kept in a `static` (which
    /// [`crate::export_bundle!`] does).
    pub fn new(def: &BundleDef) -> BundleExport {
        let h = &def.handlers;
        let stage = |handler: Option<crate::ffi::sys::XLA_FFI_Handler>| {
            handler.map_or(ptr::null(), handler_ptr)
        };
        let state = (def.state)();
        BundleExport {
            target: leak_c_string(def.target),
            instantiate: stage(h.instantiate),
            prepare: stage(h.prepare),
            initialize: stage(h.initialize),
            execute: stage(h.execute),
            state_type_name: state.map_or(ptr::null(), |s| leak_c_string(s.name())),
            type_id: state.map_or(ptr::null_mut(), |s| s.type_id_ptr().cast()),
            type_info: state.map_or(ptr::null(), |s| s.type_info_ptr().cast()),
        }
    }
}

/// Exports the bundle `$def` (a [`BundleDef`]) from a `cdylib` as the C function `$symbol`,
/// which takes nothing and returns a pointer to its [`BundleExport`] (built on first call, then
/// the same pointer every time).
///
/// ```text
/// pub const COUNTER: BundleDef = BundleDef::of::<Counter>().instantiate().execute().build();
/// rmsnorm_ffi::export_bundle!(counter_bundle, COUNTER);
/// ```
///
/// ```text
/// lib = ctypes.CDLL("libmy_bundles.so")
/// lib.counter_bundle.restype = ctypes.POINTER(BundleExport)   # mirror of the struct
/// ```
///
/// `#[no_mangle]` is what makes the symbol findable by name; it is the only reason the
/// expansion is not plain safe Rust (two exports with the same symbol would clash at link time).
#[macro_export]
macro_rules! export_bundle {
    ($symbol:ident, $def:expr) => {
        #[no_mangle]
        pub extern "C" fn $symbol() -> *const $crate::ffi::export::BundleExport {
            static EXPORT: ::std::sync::OnceLock<$crate::ffi::export::BundleExport> =
                ::std::sync::OnceLock::new();
            EXPORT.get_or_init(|| $crate::ffi::export::BundleExport::new(&$def))
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handlers::scaled_copy;
    use std::ffi::CStr;

    #[test]
    fn export_mirrors_the_bundle_def() {
        let def = scaled_copy::BUNDLE;
        let export = BundleExport::new(&def);
        // SAFETY: `new` stores NUL-terminated strings that are never freed.
        let target = unsafe { CStr::from_ptr(export.target) };
        assert_eq!(target.to_str().unwrap(), scaled_copy::TARGET);
        assert_eq!(
            export.instantiate,
            handler_ptr(def.handlers.instantiate.unwrap())
        );
        assert_eq!(export.execute, handler_ptr(def.handlers.execute.unwrap()));
        assert!(export.prepare.is_null() && export.initialize.is_null());
        let state = (def.state)().unwrap();
        // SAFETY: as above.
        let name = unsafe { CStr::from_ptr(export.state_type_name) };
        assert_eq!(name.to_str().unwrap(), state.name());
        assert_eq!(export.type_id, state.type_id_ptr().cast::<c_void>());
        assert_eq!(export.type_info, state.type_info_ptr().cast::<c_void>());
    }
}
