//! A copy of the crate that a host adopts reports into the host's registry: its live states and
//! workspace pools go through the hooks the host installed. Its own process: installing hooks is
//! for the life of the process, and would change every other test's registry.
//!
//! The host here is a counting wrapper around this copy's own registry, so that the test sees
//! both that the calls go through the hooks and that the registry gets them.

use std::sync::atomic::{AtomicU64, Ordering};

use xla_ffi_bundles::ffi::host::{self, HostError, RegistryHooks, RegistryHost};
use xla_ffi_bundles::state::registry::{HostRegistry, HOOKS};
use xla_ffi_bundles::state::{snapshot, LiveState, WorkspacePool};

static CREATED: AtomicU64 = AtomicU64::new(0);
static EXECUTED: AtomicU64 = AtomicU64::new(0);
static DETAILS: AtomicU64 = AtomicU64::new(0);
static WORKSPACE_BYTES: AtomicU64 = AtomicU64::new(0);

struct Counting;

impl RegistryHost for Counting {
    type Handle = <HostRegistry as RegistryHost>::Handle;
    fn state_created(target: &str, type_name: &str) -> (Self::Handle, u64) {
        CREATED.fetch_add(1, Ordering::Relaxed);
        HostRegistry::state_created(target, type_name)
    }
    fn state_executed(handle: &Self::Handle) {
        EXECUTED.fetch_add(1, Ordering::Relaxed);
        HostRegistry::state_executed(handle)
    }
    fn state_detail(handle: &Self::Handle, key: &str, value: &str) {
        DETAILS.fetch_add(1, Ordering::Relaxed);
        HostRegistry::state_detail(handle, key, value)
    }
    fn workspace_changed(bytes: i64, allocations: u64) {
        WORKSPACE_BYTES.fetch_add(bytes.unsigned_abs(), Ordering::Relaxed);
        HostRegistry::workspace_changed(bytes, allocations)
    }
}

static COUNTING: RegistryHooks = RegistryHooks::of::<Counting>();
/// A table that claims to be smaller than a `RegistryHooks`.
static SMALL: RegistryHooks = RegistryHooks {
    struct_size: 8,
    ..RegistryHooks::of::<Counting>()
};

#[test]
fn an_adopted_copy_reports_states_and_workspaces_through_the_hooks() {
    assert!(!host::is_hosted());
    // Before: this copy's own registry, no hook called.
    let local = LiveState::register("hooks_local", "T");
    local.record_execution();
    assert_eq!(CREATED.load(Ordering::Relaxed), 0);

    // Refused tables change nothing.
    // SAFETY: null and an undersized table are refused before use.
    assert_eq!(
        unsafe { host::install(std::ptr::null()) },
        Err(HostError::Null)
    );
    // SAFETY: `SMALL` lives for the process; its size is checked before anything else.
    assert!(matches!(
        unsafe { host::install(&SMALL) },
        Err(HostError::TooSmall { got: 8, .. })
    ));
    assert!(!host::is_hosted());

    // SAFETY: `COUNTING` is a static table of safe entries.
    unsafe { host::install(&COUNTING) }.unwrap();
    // The same table again is fine; another host is refused.
    // SAFETY: as above.
    unsafe { host::install(&COUNTING) }.unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { host::install(&HOOKS) }, Err(HostError::OtherHost));
    assert!(host::is_hosted());

    let hosted = LiveState::register("hooks_hosted", "hooks.State");
    hosted.record_execution();
    hosted.record_execution();
    // Details of a hosted state reach the host's entry (they were dropped before table
    // version 2).
    hosted.set_detail("plan", "rows=4");
    assert_eq!(DETAILS.load(Ordering::Relaxed), 1);
    assert_eq!(CREATED.load(Ordering::Relaxed), 1);
    assert_eq!(EXECUTED.load(Ordering::Relaxed), 2);
    let state = snapshot()
        .states
        .into_iter()
        .find(|s| s.id == hosted.id())
        .expect("the host's registry has it");
    assert_eq!((state.target, state.executions), ("hooks_hosted", 2));
    assert_eq!(
        state.details.get("plan").map(String::as_str),
        Some("rows=4")
    );

    let pool = WorkspacePool::<f32>::new(256, 4);
    drop(pool.checkout());
    assert_eq!(WORKSPACE_BYTES.load(Ordering::Relaxed), 1024);
    drop(pool);
    assert_eq!(
        WORKSPACE_BYTES.load(Ordering::Relaxed),
        2048,
        "the free went through too"
    );

    let id = hosted.id();
    drop(hosted);
    assert!(snapshot().states.iter().all(|s| s.id != id));
    // A state made before the host came stays where it was.
    assert!(snapshot().states.iter().any(|s| s.id == local.id()));
}

#[test]
fn the_hooks_a_library_gets_register_its_states_here() {
    use xla_ffi_bundles::ffi::host::Str;
    // A library's names are its own memory: the registry keeps copies.
    let target = String::from("hooks_test_target");
    let type_name = String::from("hooks_test.State");
    let str_of = |s: &String| Str {
        ptr: s.as_ptr(),
        len: s.len(),
    };
    let mut id = 0;
    // SAFETY: valid strings and out-parameter, as a library passes them.
    let handle = unsafe { (HOOKS.state_created)(str_of(&target), str_of(&type_name), &mut id) };
    assert!(!handle.is_null());
    drop((target, type_name));
    // SAFETY: the handle is live until `state_destroyed`.
    unsafe {
        (HOOKS.state_executed)(handle);
        (HOOKS.state_executed)(handle);
        (HOOKS.state_executed)(std::ptr::null_mut()); // ignored
    }
    let state = snapshot().states.into_iter().find(|s| s.id == id).unwrap();
    assert_eq!(
        (state.target, state.type_name, state.executions),
        ("hooks_test_target", "hooks_test.State", 2)
    );
    assert!(snapshot().executions["hooks_test_target"] >= 2);
    // SAFETY: the hooks may be called at any time.
    unsafe { (HOOKS.workspace_changed)(4096, 1) };
    // Other tests change the totals in parallel; this one's share is visible at least.
    assert!(snapshot().workspace_allocations >= 1);
    // SAFETY: as above.
    unsafe { (HOOKS.workspace_changed)(-4096, 0) };
    // SAFETY: the handle's last use.
    unsafe { (HOOKS.state_destroyed)(handle) };
    assert!(snapshot().states.iter().all(|s| s.id != id));
    // A name that is not UTF-8 is refused with a null handle.
    let bad = [0xffu8, 0xfe];
    // SAFETY: valid pointers; the bytes are just not UTF-8.
    let none = unsafe {
        (HOOKS.state_created)(
            Str {
                ptr: bad.as_ptr(),
                len: 2,
            },
            Str {
                ptr: bad.as_ptr(),
                len: 2,
            },
            &mut id,
        )
    };
    assert!(none.is_null());
}
