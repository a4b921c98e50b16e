//! The live-state registry a library reports into, across the C boundary.
//!
//! A library built on this crate (a `cdylib` with `xla-ffi-bundles` as a dependency) carries its
//! own copy of every `static` of the crate, the live-state registry included; left alone, its
//! states would be counted in a registry that `rmsnorm_ffi.stats()` never sees. So when the extension
//! registers such a library (`rmsnorm_ffi.register_library`), it first hands the library a
//! table of its own registry's functions, [`RegistryHooks`], which the library installs
//! ([`install`]); from then on the library's [`crate::state::LiveState`]s and workspace pools
//! report into the extension's registry: one registry, one id sequence, one set of totals.
//!
//! This module is the raw half: the C table, the generic `extern "C"` entries that turn a
//! [`RegistryHost`] implementation (the registry, in safe code) into such a table, and
//! [`HostedState`], a library's handle on a state registered in the host.

use std::ffi::c_void;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, Ordering};

use super::panic;

/// A string as C sees it: UTF-8 bytes and their length, borrowed for the call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Str {
    /// The first byte.
    pub ptr: *const u8,
    /// The length in bytes.
    pub len: usize,
}

impl Str {
    fn of(s: &str) -> Str {
        Str {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    /// # Safety
    /// `ptr` must point to `len` readable bytes for the call.
    unsafe fn to_str<'a>(self) -> Option<&'a str> {
        if self.ptr.is_null() {
            return None;
        }
        // SAFETY: per the contract.
        std::str::from_utf8(unsafe { std::slice::from_raw_parts(self.ptr, self.len) }).ok()
    }
}

/// The host registry's functions, as a library receives them.
///
/// Every entry is safe to call from any thread, at any time for the rest of the process (the
/// host never unloads). Part of the library table's ABI: changing it changes
/// [`super::export::LIBRARY_ABI_VERSION`].
#[repr(C)]
pub struct RegistryHooks {
    /// The size of this table in bytes, which [`install`] checks first.
    pub struct_size: usize,
    /// Registers a new live state of `type_name` for `target`; writes its id to `id` and
    /// returns a handle for the two calls below, or null if the host could not register it.
    pub state_created:
        unsafe extern "C" fn(target: Str, type_name: Str, id: *mut u64) -> *mut c_void,
    /// Counts one execution of the state behind `handle`.
    pub state_executed: unsafe extern "C" fn(handle: *mut c_void),
    /// Deregisters the state behind `handle`, which is not used again.
    pub state_destroyed: unsafe extern "C" fn(handle: *mut c_void),
    /// Adds to the workspace totals: the change in bytes held (negative when a buffer is freed)
    /// and the allocations made.
    pub workspace_changed: unsafe extern "C" fn(bytes: i64, allocations: u64),
    /// Sets one detail (`key` = `value`, both UTF-8) of the state behind `handle`, shown in its
    /// `stats()` entry. Added in table version 2 (crate 0.2): before it a library's
    /// `LiveState::set_detail` had nowhere to go.
    pub state_detail: unsafe extern "C" fn(handle: *mut c_void, key: Str, value: Str),
}

/// What a registry must do to be a host; implemented by the live-state registry
/// ([`crate::state::registry`]) in safe code.
pub trait RegistryHost: 'static {
    /// What the host keeps for one state, until it is destroyed.
    type Handle: Send + Sync + 'static;
    /// Registers a state; returns its handle and id.
    fn state_created(target: &str, type_name: &str) -> (Self::Handle, u64);
    /// Counts one execution of the state behind `handle`.
    fn state_executed(handle: &Self::Handle);
    /// Sets one detail of the state behind `handle`.
    fn state_detail(handle: &Self::Handle, key: &str, value: &str);
    /// Adds to the workspace totals: a change of the bytes held (negative when buffers are
    /// freed) and the allocations made.
    fn workspace_changed(bytes: i64, allocations: u64);
}

impl RegistryHooks {
    /// The table of `H`'s functions. Its entries catch panics (a hook must not unwind into the
    /// library) and check their pointers.
    pub const fn of<H: RegistryHost>() -> RegistryHooks {
        RegistryHooks {
            struct_size: std::mem::size_of::<RegistryHooks>(),
            state_created: state_created_entry::<H>,
            state_executed: state_executed_entry::<H>,
            state_destroyed: state_destroyed_entry::<H>,
            workspace_changed: workspace_changed_entry::<H>,
            state_detail: state_detail_entry::<H>,
        }
    }
}

unsafe extern "C" fn state_created_entry<H: RegistryHost>(
    target: Str,
    type_name: Str,
    id: *mut u64,
) -> *mut c_void {
    let result = panic::catch(
        || "the registry's state_created hook".into(),
        || {
            // SAFETY: the library passes strings readable for the call.
            let names = unsafe { (target.to_str(), type_name.to_str()) };
            let (Some(target), Some(type_name)) = names else {
                return Err(super::error::FfiError::invalid_argument(
                    "a state name that is not UTF-8",
                ));
            };
            let (handle, state_id) = H::state_created(target, type_name);
            if !id.is_null() {
                // SAFETY: a non-null `id` is the library's writable out-parameter.
                unsafe { id.write(state_id) };
            }
            Ok(Box::into_raw(Box::new(handle)).cast::<c_void>())
        },
    );
    result.unwrap_or_else(|e| {
        panic::report_unreturnable::<()>(Err(e));
        ptr::null_mut()
    })
}

unsafe extern "C" fn state_executed_entry<H: RegistryHost>(handle: *mut c_void) {
    // SAFETY: a non-null handle comes from `state_created_entry::<H>` and is not destroyed yet
    // (the library's `HostedState` owns it until its drop).
    if let Some(handle) = unsafe { handle.cast::<H::Handle>().as_ref() } {
        let result = panic::catch(
            || "the registry's state_executed hook".into(),
            || {
                H::state_executed(handle);
                Ok(())
            },
        );
        panic::report_unreturnable(result);
    }
}

unsafe extern "C" fn state_detail_entry<H: RegistryHost>(
    handle: *mut c_void,
    key: Str,
    value: Str,
) {
    // SAFETY: as in `state_executed_entry`.
    if let Some(handle) = unsafe { handle.cast::<H::Handle>().as_ref() } {
        let result = panic::catch(
            || "the registry's state_detail hook".into(),
            || {
                // SAFETY: the library passes strings readable for the call.
                match unsafe { (key.to_str(), value.to_str()) } {
                    (Some(key), Some(value)) => H::state_detail(handle, key, value),
                    _ => {
                        return Err(super::error::FfiError::invalid_argument(
                            "a state detail that is not UTF-8",
                        ))
                    }
                }
                Ok(())
            },
        );
        panic::report_unreturnable(result);
    }
}

unsafe extern "C" fn state_destroyed_entry<H: RegistryHost>(handle: *mut c_void) {
    if handle.is_null() {
        return;
    }
    let result = panic::catch(
        || "the registry's state_destroyed hook".into(),
        || {
            // SAFETY: as above; this is the handle's last use, so it is freed once.
            drop(unsafe { Box::from_raw(handle.cast::<H::Handle>()) });
            Ok(())
        },
    );
    panic::report_unreturnable(result);
}

unsafe extern "C" fn workspace_changed_entry<H: RegistryHost>(bytes: i64, allocations: u64) {
    let result = panic::catch(
        || "the registry's workspace_changed hook".into(),
        || {
            H::workspace_changed(bytes, allocations);
            Ok(())
        },
    );
    panic::report_unreturnable(result);
}

/// The hooks this copy of the crate reports into; null until a host installs its own.
static INSTALLED: AtomicPtr<RegistryHooks> = AtomicPtr::new(ptr::null_mut());

/// Why [`install`] refused a table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// The table pointer is null.
    #[error("the registry table is null")]
    Null,
    /// The table is smaller than the `RegistryHooks` this library knows.
    #[error("the registry table has {got} bytes, this library needs at least {needed}")]
    TooSmall {
        /// The table's declared size.
        got: usize,
        /// The size this library needs.
        needed: usize,
    },
    /// This library already reports into another table.
    #[error("this library already reports into another registry")]
    OtherHost,
}

/// Makes `hooks` the registry this copy of the crate reports into. Installing the same table
/// again is a no-op; another one is refused (states already reported must stay where they are).
///
/// # Safety
/// `hooks` must be null or point to a `RegistryHooks` that stays valid and unchanged for the
/// rest of the process, with entries safe to call from any thread.
pub unsafe fn install(hooks: *const RegistryHooks) -> Result<(), HostError> {
    if hooks.is_null() {
        return Err(HostError::Null);
    }
    // SAFETY: non-null, and valid per the contract; `struct_size` comes first.
    let size = unsafe { ptr::addr_of!((*hooks).struct_size).read() };
    let needed = std::mem::size_of::<RegistryHooks>();
    if size < needed {
        return Err(HostError::TooSmall { got: size, needed });
    }
    match INSTALLED.compare_exchange(
        ptr::null_mut(),
        hooks.cast_mut(),
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        Ok(_) => Ok(()),
        Err(current) if ptr::eq(current, hooks) => Ok(()),
        Err(_) => Err(HostError::OtherHost),
    }
}

fn installed() -> Option<&'static RegistryHooks> {
    // SAFETY: only tables that passed `install` are stored, and they live for the process.
    unsafe { INSTALLED.load(Ordering::Acquire).as_ref() }
}

/// Whether this copy of the crate reports into a host's registry.
pub fn is_hosted() -> bool {
    installed().is_some()
}

/// A state registered in the host's registry; deregisters it on drop.
pub struct HostedState {
    hooks: &'static RegistryHooks,
    handle: NonNull<c_void>,
    id: u64,
}

// SAFETY: the handle is the host's `Box<H::Handle>` with `H::Handle: Send + Sync`, and the
// hooks may be called from any thread (the `RegistryHooks` contract).
unsafe impl Send for HostedState {}
// SAFETY: as above; `&HostedState` only counts executions, which the host does atomically.
unsafe impl Sync for HostedState {}

impl HostedState {
    /// Registers a state in the host's registry; `None` when no host is installed or the host
    /// could not register it (then the caller keeps it in its own registry).
    pub fn register(target: &str, type_name: &str) -> Option<HostedState> {
        let hooks = installed()?;
        let mut id = 0;
        // SAFETY: the strings are valid for the call; `id` is a writable local.
        let handle = unsafe { (hooks.state_created)(Str::of(target), Str::of(type_name), &mut id) };
        NonNull::new(handle).map(|handle| HostedState { hooks, handle, id })
    }

    /// The id the host gave the state.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Counts one execution in the host.
    pub fn record_execution(&self) {
        // SAFETY: the handle came from this host's `state_created` and is not destroyed yet.
        unsafe { (self.hooks.state_executed)(self.handle.as_ptr()) }
    }

    /// Sets one detail of the state in the host (one call; the host takes a lock).
    pub fn set_detail(&self, key: &str, value: &str) {
        // SAFETY: as above; the strings are valid for the call.
        unsafe { (self.hooks.state_detail)(self.handle.as_ptr(), Str::of(key), Str::of(value)) }
    }
}

impl Drop for HostedState {
    fn drop(&mut self) {
        // SAFETY: as above; the handle is not used after this.
        unsafe { (self.hooks.state_destroyed)(self.handle.as_ptr()) }
    }
}

/// Reports a change of the workspace totals to the host; `false` when no host is installed.
pub fn report_workspace(bytes: i64, allocations: u64) -> bool {
    match installed() {
        Some(hooks) => {
            // SAFETY: the hooks may be called from any thread at any time.
            unsafe { (hooks.workspace_changed)(bytes, allocations) };
            true
        }
        None => false,
    }
}
