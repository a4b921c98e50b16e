//! PyCapsules holding the raw pointers JAX registers: handler entries, type ids, type infos.
//!
//! `jax.ffi.register_ffi_target` and `register_ffi_type` read the capsule's pointer and ignore
//! its name, so the capsules are unnamed and have no destructor: they point to `'static` data.

use std::ffi::c_void;

use pyo3::prelude::*;

use super::sys;
use super::types::StateTypeRegistration;

fn capsule(py: Python<'_>, pointer: *mut c_void) -> PyResult<Bound<'_, PyAny>> {
    // SAFETY: we hold the GIL (`py`); `pointer` is non-null and points to static data or code
    // that outlives the capsule; no name and no destructor are needed.
    let raw = unsafe { pyo3::ffi::PyCapsule_New(pointer, std::ptr::null(), None) };
    // SAFETY: `raw` is a new reference or null with a Python error set.
    unsafe { Bound::from_owned_ptr_or_err(py, raw) }
}

/// A capsule holding a handler's function pointer.
pub fn handler(py: Python<'_>, handler: sys::XLA_FFI_Handler) -> PyResult<Bound<'_, PyAny>> {
    capsule(py, handler as *mut c_void)
}

/// The `{"type_id": capsule, "type_info": capsule}` pair of a state type.
pub fn state_type<'py>(
    py: Python<'py>,
    registration: &'static StateTypeRegistration,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    library_state_type(py, registration.type_id_ptr(), registration.type_info_ptr())
}

/// The capsule pair of a state type of a library table (`super::library`), whose pointers are
/// to the library's `'static` type id cell and type info.
pub fn library_state_type<'py>(
    py: Python<'py>,
    type_id: *mut sys::XLA_FFI_TypeId,
    type_info: *const sys::XLA_FFI_TypeInfo,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    Ok((
        capsule(py, type_id.cast())?,
        capsule(py, type_info.cast_mut().cast())?,
    ))
}
