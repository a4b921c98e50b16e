//! The process-wide registry of live states.
//!
//! Every state made by an instantiate stage holds a [`LiveState`]: creating it registers the
//! state (with an id, its target and type), dropping it (when XLA runs the state's deleter)
//! removes it. The totals and per-target execution counts are atomics, so recording an
//! execution on the hot path is two relaxed increments and no allocation or lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use dashmap::DashMap;
use once_cell::sync::Lazy;
use parking_lot::Mutex;

/// What the registry keeps about one live state.
#[derive(Debug)]
pub struct StateRecord {
    pub id: u64,
    pub target: &'static str,
    pub type_name: &'static str,
    executions: AtomicU64,
    /// What the state says about itself (e.g. which stage loaded a device's resources), set
    /// off the hot path and shown by `stats()`.
    details: Mutex<BTreeMap<String, String>>,
}

impl StateRecord {
    pub fn executions(&self) -> u64 {
        self.executions.load(Ordering::Relaxed)
    }
}

pub(crate) struct Registry {
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
}

/// The registry entry of one state; keep it in the state, it deregisters on drop.
#[derive(Debug)]
pub struct LiveState {
    record: Arc<StateRecord>,
    target_executions: &'static AtomicU64,
}

impl LiveState {
    /// Registers a new state of `type_name` made for `target`.
    pub fn register(target: &'static str, type_name: &'static str) -> LiveState {
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
            record,
            target_executions,
        }
    }

    pub fn id(&self) -> u64 {
        self.record.id
    }

    /// The target this state was made for.
    pub fn target(&self) -> &'static str {
        self.record.target
    }

    pub fn executions(&self) -> u64 {
        self.record.executions()
    }

    /// Sets one detail shown in this state's `stats()` entry (takes a lock: not for the hot
    /// path).
    pub fn set_detail(&self, key: impl Into<String>, value: impl Into<String>) {
        self.record.details.lock().insert(key.into(), value.into());
    }

    /// Counts one execution of this state (and of its target). No allocation, no lock.
    pub fn record_execution(&self) {
        self.record.executions.fetch_add(1, Ordering::Relaxed);
        self.target_executions.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for LiveState {
    fn drop(&mut self) {
        let registry = &*REGISTRY;
        registry.states.remove(&self.record.id);
        registry.destroyed.fetch_add(1, Ordering::Relaxed);
    }
}

/// One live state in a [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateSnapshot {
    pub id: u64,
    pub target: &'static str,
    pub type_name: &'static str,
    pub executions: u64,
    pub details: BTreeMap<String, String>,
}

/// A point-in-time copy of the registry's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub live_states: u64,
    pub created_states: u64,
    pub destroyed_states: u64,
    pub executions: BTreeMap<&'static str, u64>,
    pub workspace_bytes: i64,
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
        assert_eq!(mid.created_states - before.created_states, 2);
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
        assert_eq!(after.destroyed_states - before.destroyed_states, 2);
        assert!(after.states.iter().all(|s| s.id != ida && s.id != idb));
    }
}
