//! State types: the type id XLA assigns, the type info whose deleter drops the state, and the
//! trait that ties a Rust type to both.
//!
//! XLA owns a state from the moment the instantiate stage hands it over (`XLA_FFI_State_Set`)
//! until the executable dies, when it calls the deleter from the type info. The state is a
//! `Box<T>` turned into a raw pointer; [`delete_state`] turns it back and drops it, behind
//! [`super::panic::catch`]. Below the context in the layers: how a stage fetches its state is
//! [`super::bundle::BundleState`]'s business.

use std::any::TypeId;
use std::ffi::c_void;
use std::ptr;
use std::sync::atomic::{AtomicI64, Ordering};

use super::error::{FfiError, FfiResult};
use super::panic;
use super::sys;

/// An `XLA_FFI_TypeId` that XLA may write through a pointer (type registration is in-out).
#[repr(transparent)]
pub struct TypeIdCell(AtomicI64);

impl TypeIdCell {
    /// A cell holding 0, the id before XLA assigns one.
    pub const fn unknown() -> Self {
        TypeIdCell(AtomicI64::new(0))
    }

    /// The id XLA assigned, or 0 before registration.
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }

    /// The pointer XLA reads and writes. `AtomicI64` has the layout of `i64`, which is the
    /// layout of `XLA_FFI_TypeId`.
    pub fn as_ptr(&self) -> *mut sys::XLA_FFI_TypeId {
        self.0.as_ptr().cast()
    }
}

/// `XLA_FFI_TypeInfo` in a `static`: it holds only a function pointer and a null extension.
#[repr(transparent)]
pub struct TypeInfoCell(sys::XLA_FFI_TypeInfo);

// SAFETY: the struct is never mutated after construction, and its only pointers are a null
// extension and a function pointer.
unsafe impl Sync for TypeInfoCell {}

/// Everything XLA needs to know about one state type.
pub struct StateTypeRegistration {
    name: &'static str,
    type_id: TypeIdCell,
    type_info: TypeInfoCell,
    /// The Rust type the deleter frees. [`StateType::registration`] is a safe trait method,
    /// so a wrong impl could hand out another type's registration; the context checks this
    /// before it casts a state pointer.
    rust_type: fn() -> TypeId,
}

impl StateTypeRegistration {
    /// The registration of `T`, called `name` in XLA's process-wide type registry.
    pub const fn new<T: StateType>(name: &'static str) -> Self {
        StateTypeRegistration {
            name,
            type_id: TypeIdCell::unknown(),
            type_info: TypeInfoCell(sys::XLA_FFI_TypeInfo {
                struct_size: sys::XLA_FFI_TypeInfo::STRUCT_SIZE,
                extension_start: ptr::null_mut(),
                deleter: Some(delete_state::<T>),
            }),
            rust_type: TypeId::of::<T>,
        }
    }

    /// Whether this registration is `T`'s (its deleter frees a `T`).
    pub(crate) fn check_type<T: 'static>(&self) -> FfiResult<()> {
        if (self.rust_type)() == TypeId::of::<T>() {
            Ok(())
        } else {
            Err(FfiError::internal(format!(
                "state type `{}` is registered for another Rust type than `{}`",
                self.name,
                std::any::type_name::<T>()
            )))
        }
    }

    /// The name in XLA's process-wide type registry.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The id XLA assigned, 0 until the type is registered.
    pub fn type_id(&self) -> i64 {
        self.type_id.get()
    }

    /// The id cell XLA fills in at type registration (the `"type_id"` capsule).
    pub fn type_id_ptr(&self) -> *mut sys::XLA_FFI_TypeId {
        self.type_id.as_ptr()
    }

    /// The type info with the deleter (the `"type_info"` capsule).
    pub fn type_info_ptr(&self) -> *const sys::XLA_FFI_TypeInfo {
        &self.type_info.0
    }
}

/// A Rust type that can be an XLA FFI state. Declare with [`crate::state_type!`] (which also
/// implements [`super::bundle::BundleState`], the stages' view of it).
pub trait StateType: Send + Sync + Sized + 'static {
    /// The registration of this type: one `static` per type, as [`crate::state_type!`]
    /// declares it.
    fn registration() -> &'static StateTypeRegistration;
}

/// The deleter XLA calls when the executable that owns a `T` state is destroyed.
///
/// # Safety
/// `object` must be null or a pointer produced by `Box::<T>::into_raw` in
/// `Context::set_state` and not freed since; XLA calls each deleter once per
/// state.
pub unsafe extern "C" fn delete_state<T: StateType>(object: *mut c_void) {
    if object.is_null() {
        return;
    }
    let result = panic::catch(
        || format!("the deleter of state type `{}`", std::any::type_name::<T>()),
        // SAFETY: per the function's contract, `object` is a live `Box<T>` we gave to XLA.
        || {
            drop(unsafe { Box::from_raw(object.cast::<T>()) });
            Ok(())
        },
    );
    panic::report_unreturnable(result);
}
