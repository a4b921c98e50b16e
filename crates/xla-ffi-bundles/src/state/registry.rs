//! The process-wide registry of live states.
//!
//! Every state made by an instantiate stage holds a [`LiveState`]: creating it registers the
//! state (with an id, its target and type), dropping it (when XLA runs the state's deleter)
//! removes it. The totals and per-target execution counts are atomics, so recording an
//! execution on the hot path is two relaxed increments and no allocation or lock.
//!
//! One registry per process, whatever the number of libraries: the copy of this crate in the
//! Python extension is the host, and a library registered with `rmsnorm_ffi.register_library`
//! gets the host's [`HOOKS`] and reports into it ([`crate::ffi::host`]). Its [`LiveState`]s are
//! then entries of the host's registry (a hosted state records an execution with one call into
//! the host), and its workspace pools count in the host's totals. Only a copy that no host
//! adopted keeps its own figures.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use dashmap::DashMap;
use once_cell::sync::Lazy;
use parking_lot::Mutex;

use crate::ffi::host::{self, HostedState, RegistryHooks, RegistryHost};

/// What the registry keeps about one live state.
#[derive(Debug)]
pub struct StateRecord {
    /// The state's id, unique in this registry.
    pub id: u64,
    /// The target the state was made for.
    pub target: &'static str,
    /// The name of the state's type.
    pub type_name: &'static str,
    executions: AtomicU64,
    /// What the state says about itself (e.g. which stage loaded a device's resources), set
    /// off the hot path and shown by `stats()`.
    details: Mutex<BTreeMap<String, String>>,
}

impl StateRecord {
    /// The executions of this state recorded so far.
    pub fn executions(&self) -> u64 {
        self.executions.load(Ordering::Relaxed)
    }
}

pub(crate) struct Registry {
    /// Names of states reported by libraries, copied once each (a library's strings are its
    /// own), so that records can keep `&'static str`s.
    names: DashMap<String, &'static str>,
    states: DashMap<u64, Arc<StateRecord>>,
    next_id: AtomicU64,
    created: AtomicU64,
    destroyed: AtomicU64,
    /// Executions per target; entries are leaked once per target name and never removed, so
    /// a state can keep a `&'static` to its counter.
    executions: DashMap<&'static str, &'static AtomicU64>,
    pub(crate) workspace_bytes: AtomicI64,
    pub(crate) workspace_allocations: AtomicU64,
}

pub(crate) static REGISTRY: Lazy<Registry> = Lazy::new(|| Registry {
    names: DashMap::new(),
    states: DashMap::new(),
    next_id: AtomicU64::new(1),
    created: AtomicU64::new(0),
    destroyed: AtomicU64::new(0),
    executions: DashMap::new(),
    workspace_bytes: AtomicI64::new(0),
    workspace_allocations: AtomicU64::new(0),
});

impl Registry {
    fn target_counter(&self, target: &'static str) -> &'static AtomicU64 {
        *self
            .executions
            .entry(target)
            .or_insert_with(|| Box::leak(Box::new(AtomicU64::new(0))))
    }

    /// `name` as a `&'static str`, copied on first use (bounded by the distinct names).
    fn intern(&self, name: &str) -> &'static str {
        if let Some(interned) = self.names.get(name) {
            return *interned;
        }
        *self
            .names
            .entry(name.to_string())
            .or_insert_with(|| Box::leak(name.to_string().into_boxed_str()))
    }
}

/// Adds to the workspace totals: in the host's registry if this copy reports into one.
pub(crate) fn workspace_changed(bytes: i64, allocations: u64) {
    if !host::report_workspace(bytes, allocations) {
        REGISTRY.workspace_bytes.fetch_add(bytes, Ordering::Relaxed);
        REGISTRY
            .workspace_allocations
            .fetch_add(allocations, Ordering::Relaxed);
    }
}

/// The registry entry of one state; keep it in the state, it deregisters on drop.
pub struct LiveState {
    target: &'static str,
    entry: Entry,
}

enum Entry {
    /// In this copy's registry.
    Local {
        record: Arc<StateRecord>,
        target_executions: &'static AtomicU64,
    },
    /// In the registry of the host this copy reports into.
    Hosted(HostedState),
}

impl std::fmt::Debug for LiveState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosted = matches!(self.entry, Entry::Hosted(_));
        f.debug_struct("LiveState")
            .field("id", &self.id())
            .field("hosted", &hosted)
            .finish()
    }
}

impl LiveState {
    /// Registers a new state of `type_name` made for `target`, in the host's registry if this
    /// copy of the crate reports into one.
    pub fn register(target: &'static str, type_name: &'static str) -> LiveState {
        match HostedState::register(target, type_name) {
            Some(hosted) => LiveState {
                target,
                entry: Entry::Hosted(hosted),
            },
            None => LiveState::register_local(target, type_name),
        }
    }

    /// Registers a state in this copy's own registry.
    fn register_local(target: &'static str, type_name: &'static str) -> LiveState {
        let registry = &*REGISTRY;
        let id = registry.next_id.fetch_add(1, Ordering::Relaxed);
        let record = Arc::new(StateRecord {
            id,
            target,
            type_name,
            executions: AtomicU64::new(0),
            details: Mutex::new(BTreeMap::new()),
        });
        let target_executions = registry.target_counter(target);
        registry.states.insert(id, Arc::clone(&record));
        registry.created.fetch_add(1, Ordering::Relaxed);
        LiveState {
            target,
            entry: Entry::Local {
                record,
                target_executions,
            },
        }
    }

    /// The state's id in the registry that holds it.
    pub fn id(&self) -> u64 {
        match &self.entry {
            Entry::Local { record, .. } => record.id,
            Entry::Hosted(hosted) => hosted.id(),
        }
    }

    /// The target this state was made for.
    pub fn target(&self) -> &'static str {
        self.target
    }

    /// Sets one detail shown in this state's `stats()` entry (takes a lock: not for the hot
    /// path). A hosted state's detail goes to the host's registry through its hooks, so a
    /// library's states show their details in the host's `stats()` like the host's own.
    pub fn set_detail(&self, key: impl Into<String>, value: impl Into<String>) {
        match &self.entry {
            Entry::Local { record, .. } => {
                record.details.lock().insert(key.into(), value.into());
            }
            Entry::Hosted(hosted) => hosted.set_detail(&key.into(), &value.into()),
        }
    }

    /// Counts one execution of this state (and of its target). No allocation, no lock; one
    /// call into the host for a hosted state.
    pub fn record_execution(&self) {
        match &self.entry {
            Entry::Local {
                record,
                target_executions,
            } => {
                record.executions.fetch_add(1, Ordering::Relaxed);
                target_executions.fetch_add(1, Ordering::Relaxed);
            }
            Entry::Hosted(hosted) => hosted.record_execution(),
        }
    }
}

impl Drop for LiveState {
    fn drop(&mut self) {
        if let Entry::Local { record, .. } = &self.entry {
            let registry = &*REGISTRY;
            registry.states.remove(&record.id);
            registry.destroyed.fetch_add(1, Ordering::Relaxed);
        }
        // A hosted state deregisters when its `HostedState` drops.
    }
}

/// This registry as a host for libraries: their states become local states here.
pub struct HostRegistry;

impl RegistryHost for HostRegistry {
    type Handle = LiveState;

    fn state_created(target: &str, type_name: &str) -> (LiveState, u64) {
        let registry = &*REGISTRY;
        let live = LiveState::register_local(registry.intern(target), registry.intern(type_name));
        let id = live.id();
        (live, id)
    }

    fn state_executed(handle: &LiveState) {
        handle.record_execution();
    }

    fn state_detail(handle: &LiveState, key: &str, value: &str) {
        handle.set_detail(key, value);
    }

    fn workspace_changed(bytes: i64, allocations: u64) {
        REGISTRY.workspace_bytes.fetch_add(bytes, Ordering::Relaxed);
        REGISTRY
            .workspace_allocations
            .fetch_add(allocations, Ordering::Relaxed);
    }
}

/// The table this registry hands a library, so that the library reports here.
pub static HOOKS: RegistryHooks = RegistryHooks::of::<HostRegistry>();

/// One live state in a [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateSnapshot {
    /// The state's id, unique in this registry.
    pub id: u64,
    /// The target the state was made for.
    pub target: &'static str,
    /// The name of the state's type.
    pub type_name: &'static str,
    /// The executions of this state recorded so far.
    pub executions: u64,
    /// What the state says about itself ([`LiveState::set_detail`]).
    pub details: BTreeMap<String, String>,
}

/// A point-in-time copy of the registry's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// States alive now.
    pub live_states: u64,
    /// States registered since the process started.
    pub created_states: u64,
    /// States dropped since the process started.
    pub destroyed_states: u64,
    /// Executions per target, over all its states, live or not.
    pub executions: BTreeMap<&'static str, u64>,
    /// Bytes held by workspace pools now.
    pub workspace_bytes: i64,
    /// Workspace buffers allocated since the process started.
    pub workspace_allocations: u64,
    /// Live states, by id.
    pub states: Vec<StateSnapshot>,
}

/// Takes a snapshot. Figures are read one after the other, not atomically together.
pub fn snapshot() -> Snapshot {
    let registry = &*REGISTRY;
    let mut states: Vec<StateSnapshot> = registry
        .states
        .iter()
        .map(|entry| {
            let r = entry.value();
            StateSnapshot {
                id: r.id,
                target: r.target,
                type_name: r.type_name,
                executions: r.executions(),
                details: r.details.lock().clone(),
            }
        })
        .collect();
    states.sort_by_key(|s| s.id);
    Snapshot {
        live_states: states.len() as u64,
        created_states: registry.created.load(Ordering::Relaxed),
        destroyed_states: registry.destroyed.load(Ordering::Relaxed),
        executions: registry
            .executions
            .iter()
            .map(|e| (*e.key(), e.value().load(Ordering::Relaxed)))
            .collect(),
        workspace_bytes: registry.workspace_bytes.load(Ordering::Relaxed),
        workspace_allocations: registry.workspace_allocations.load(Ordering::Relaxed),
        states,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_count_and_drop() {
        let before = snapshot();
        let a = LiveState::register("registry_test_target", "T");
        let b = LiveState::register("registry_test_target", "T");
        assert_ne!(a.id(), b.id());
        a.record_execution();
        a.record_execution();
        b.record_execution();
        let mid = snapshot();
        // The counters are the process's: other tests running on libtest's threads create and
        // drop states meanwhile, so only a lower bound holds for them (an exact delta failed
        // whenever one did so inside this window); this test's own states are checked by id.
        assert!(mid.created_states - before.created_states >= 2);
        assert!(mid.states.iter().any(|s| s.id == b.id()));
        assert_eq!(mid.executions["registry_test_target"], 3);
        assert_eq!(
            mid.states
                .iter()
                .find(|s| s.id == a.id())
                .unwrap()
                .executions,
            2
        );
        let (ida, idb) = (a.id(), b.id());
        drop(a);
        drop(b);
        let after = snapshot();
        assert!(after.destroyed_states - before.destroyed_states >= 2);
        assert!(after.states.iter().all(|s| s.id != ida && s.id != idb));
    }
}
