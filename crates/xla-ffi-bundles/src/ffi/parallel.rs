//! Parallel loops on XLA's intra-op thread pool, allocating nothing per call.
//!
//! [`ParallelJobs::run`] splits work into numbered chunks. The calling thread and up to
//! `workers - 1` tasks scheduled on XLA's pool claim chunks from an atomic counter until none
//! are left; the caller then waits only for chunks that were claimed, never for a task to
//! start. So a pool that is busy (or has one thread, or runs tasks on the caller) can delay the
//! work but never deadlock it.
//!
//! A task may start after the call has returned. It finds no chunk to claim and leaves without
//! touching the loop body; what it does touch, the job slot, is reference-counted, and a slot is
//! reused only when no task holds it any more. Slots live in the state (a small pool), so after
//! warm-up nothing is allocated: the task's data pointer is the slot itself.
//!
//! [`DisjointChunks`] hands out `&mut` sub-slices of an output by chunk index, each at most
//! once (checked with an atomic bit set), so a loop body can write its rows in safe code.
//!
//! The synchronization goes through the private `sync` module, which is `std` (and crossbeam's queue) in every
//! build, and loom's models under the test-only feature `loom`: the model-checking tests at the
//! bottom run this very code under every interleaving loom explores (see there for what that
//! proves and what it does not).

use std::ffi::c_void;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};

use self::sync::{fence, Arc, AtomicBool, AtomicU64, AtomicUsize, IdleQueue, Ordering, UnsafeCell};
use super::context::Context;
use super::error::{FfiError, FfiResult};
use super::sys;

/// The primitives of this module: `std`'s, or loom's models of them (feature `loom`, tests
/// only). `UnsafeCell` has loom's access API (`with`, `with_mut`) in both, so that loom can
/// check every access to the loop body for races.
#[cfg(not(feature = "loom"))]
mod sync {
    pub use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
    pub use std::sync::Arc;

    /// `std::cell::UnsafeCell` with loom's API.
    pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub const fn new(value: T) -> Self {
            UnsafeCell(std::cell::UnsafeCell::new(value))
        }
        pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }
        pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }

    /// A bounded lock-free queue of idle slots.
    pub struct IdleQueue<T>(crossbeam::queue::ArrayQueue<T>);

    impl<T> IdleQueue<T> {
        pub fn new(capacity: usize) -> Self {
            IdleQueue(crossbeam::queue::ArrayQueue::new(capacity))
        }
        pub fn push(&self, value: T) -> Result<(), T> {
            self.0.push(value)
        }
        pub fn pop(&self) -> Option<T> {
            self.0.pop()
        }
        pub fn len(&self) -> usize {
            self.0.len()
        }
    }

    /// One step of waiting for other threads: spin a little, then yield.
    pub fn wait_step(spins: &mut u32) {
        *spins += 1;
        if *spins < 256 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

#[cfg(feature = "loom")]
mod sync {
    pub use loom::cell::UnsafeCell;
    pub use loom::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
    pub use loom::sync::Arc;

    /// crossbeam's `ArrayQueue` as loom sees it: a bounded queue whose push and pop are atomic
    /// (loom cannot look inside crossbeam, whose own tests cover its lock-freedom).
    pub struct IdleQueue<T> {
        items: loom::sync::Mutex<std::collections::VecDeque<T>>,
        capacity: usize,
    }

    impl<T> IdleQueue<T> {
        pub fn new(capacity: usize) -> Self {
            IdleQueue {
                items: loom::sync::Mutex::new(std::collections::VecDeque::new()),
                capacity,
            }
        }
        pub fn push(&self, value: T) -> Result<(), T> {
            let mut items = self.items.lock().unwrap();
            if items.len() == self.capacity {
                return Err(value);
            }
            items.push_back(value);
            Ok(())
        }
        pub fn pop(&self) -> Option<T> {
            self.items.lock().unwrap().pop_front()
        }
        pub fn len(&self) -> usize {
            self.items.lock().unwrap().len()
        }
    }

    /// Waiting is a yield to loom's scheduler.
    pub fn wait_step(_spins: &mut u32) {
        loom::thread::yield_now();
    }
}

/// Chunks one [`ParallelJobs::run`] may have (the width of [`DisjointChunks`]' bit set).
pub const MAX_CHUNKS: usize = 64;

type Body<'a> = dyn Fn(usize) + Sync + 'a;

/// One parallel loop in flight.
struct JobSlot {
    next: AtomicUsize,
    done: AtomicUsize,
    total: AtomicUsize,
    panicked: AtomicBool,
    /// The loop body, set by the owner before any task is scheduled and cleared after every
    /// claimed chunk is done. Only read after claiming a chunk.
    body: UnsafeCell<Option<*const Body<'static>>>,
}

// SAFETY: `body` is written only by the owner while no task can read it (before scheduling,
// after every claimed chunk finished); tasks read it only between claiming a chunk and marking
// it done, during which the owner waits. The pointee is `Sync`. (The loom tests check this.)
unsafe impl Sync for JobSlot {}
// SAFETY: as above; the slot moves between threads only through `Arc`.
unsafe impl Send for JobSlot {}

impl JobSlot {
    fn new() -> Self {
        JobSlot {
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            total: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            body: UnsafeCell::new(None),
        }
    }

    /// Claims and runs chunks until none are left.
    fn work(&self) {
        let total = self.total.load(Ordering::Acquire);
        loop {
            let chunk = self.next.fetch_add(1, Ordering::AcqRel);
            if chunk >= total {
                return;
            }
            // SAFETY: a chunk was claimed, so the owner is waiting and `body` is set and alive.
            let body = self
                .body
                .with(|body| unsafe { *body })
                .expect("a claimed chunk has a body");
            // SAFETY: the body outlives every claimed chunk (see the type's comment).
            let result = catch_unwind(AssertUnwindSafe(|| unsafe { (*body)(chunk) }));
            if let Err(payload) = result {
                self.panicked.store(true, Ordering::Release);
                std::mem::forget(payload);
            }
            self.done.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// A pool of job slots, one per loop that may be in flight at once; keep it in the state.
pub struct ParallelJobs {
    idle: IdleQueue<Arc<JobSlot>>,
}

impl Default for ParallelJobs {
    fn default() -> Self {
        Self::new()
    }
}

impl ParallelJobs {
    /// An empty pool: slots are made on first use, and up to 64 idle ones kept for reuse.
    pub fn new() -> Self {
        ParallelJobs {
            idle: IdleQueue::new(64),
        }
    }

    /// A slot no task holds any more, or a new one.
    fn checkout(&self) -> Arc<JobSlot> {
        for _ in 0..self.idle.len() {
            match self.idle.pop() {
                Some(slot) if Arc::strong_count(&slot) == 1 => {
                    // Pairs with the release in the last task's `Arc` drop: everything that
                    // task did to the slot happens before we reset it. (A late task touches
                    // only atomics, since it claims nothing, so the loom models pass without
                    // the fence too; it keeps the reset ordered after anything a task does.)
                    fence(Ordering::Acquire);
                    return slot;
                }
                // A late task still holds it: put it back for later.
                Some(slot) => {
                    let _ = self.idle.push(slot);
                }
                None => break,
            }
        }
        Arc::new(JobSlot::new())
    }

    /// Runs `body(chunk)` for every chunk in `0..chunks`, on the caller and up to
    /// `workers - 1` tasks of XLA's thread pool. Returns when every chunk is done.
    pub fn run(
        &self,
        ctx: &Context<'_>,
        chunks: usize,
        workers: usize,
        body: &(dyn Fn(usize) + Sync),
    ) -> FfiResult<()> {
        self.run_on(chunks, workers, body, |task, data| {
            // SAFETY: `task(data)` may run once, at any time, on any thread: what `run_on`
            // promises of the tasks it schedules.
            unsafe { ctx.schedule_raw(task, data) }.is_ok()
        })
    }

    /// [`Self::run`] with the thread pool as a function: `schedule(task, data)` either arranges
    /// for `task(data)` to be called exactly once, on any thread, at any time (even after this
    /// returns), and returns true, or does not call it and returns false.
    pub(crate) fn run_on(
        &self,
        chunks: usize,
        workers: usize,
        body: &(dyn Fn(usize) + Sync),
        mut schedule: impl FnMut(sys::XLA_FFI_Task, *mut c_void) -> bool,
    ) -> FfiResult<()> {
        if chunks == 0 {
            return Ok(());
        }
        if workers <= 1 || chunks == 1 {
            (0..chunks).for_each(body);
            return Ok(());
        }
        let slot = self.checkout();
        slot.next.store(0, Ordering::Relaxed);
        slot.done.store(0, Ordering::Relaxed);
        slot.panicked.store(false, Ordering::Relaxed);
        // SAFETY: erasing the lifetime is sound because `body` is cleared below only after every
        // claimed chunk is done, and unclaimed chunks never read it.
        let erased: *const Body<'static> = unsafe { std::mem::transmute(body as *const Body<'_>) };
        // SAFETY: no task holds this slot (checked in `checkout`), so nobody reads `body` now.
        slot.body.with_mut(|body| unsafe { *body = Some(erased) });
        slot.total.store(chunks, Ordering::Release);

        for _ in 1..workers.min(chunks) {
            let data = Arc::into_raw(Arc::clone(&slot)).cast_mut().cast::<c_void>();
            // `run_task` takes back the `Arc` leaked above and may run at any time on any
            // thread; the slot stays alive through that `Arc`.
            if !schedule(run_task, data) {
                // SAFETY: the pool refused the task, so the `Arc` is still ours.
                drop(unsafe { Arc::from_raw(data.cast::<JobSlot>()) });
                break;
            }
        }
        slot.work();
        let mut spins = 0u32;
        while slot.done.load(Ordering::Acquire) < chunks {
            sync::wait_step(&mut spins);
        }
        // SAFETY: every chunk is done: no task will read `body` again.
        slot.body.with_mut(|body| unsafe { *body = None });
        let panicked = slot.panicked.load(Ordering::Acquire);
        let _ = self.idle.push(slot);
        if panicked {
            return Err(FfiError::Panic {
                context: "a parallel loop chunk".into(),
                message: "a chunk panicked (see stderr)".into(),
            });
        }
        Ok(())
    }
}

/// The `XLA_FFI_Task` of [`ParallelJobs::run`].
unsafe extern "C" fn run_task(data: *mut c_void) {
    // SAFETY: `data` is an `Arc<JobSlot>` leaked by `run` for this task alone.
    let slot = unsafe { Arc::from_raw(data.cast_const().cast::<JobSlot>()) };
    let result = super::panic::catch(
        || "a parallel loop task".into(),
        || {
            slot.work();
            Ok(())
        },
    );
    super::panic::report_unreturnable(result);
}

/// An output split into numbered chunks that parallel loop bodies may each take once, mutably.
pub struct DisjointChunks<'a, T> {
    ptr: *mut T,
    len: usize,
    /// Chunk `c` covers `bounds(c)`; chunks must not overlap (checked at construction).
    starts: [usize; MAX_CHUNKS + 1],
    count: usize,
    taken: AtomicU64,
    _life: PhantomData<&'a mut [T]>,
}

// SAFETY: each chunk is handed out at most once (the `taken` bit set), so two threads never get
// overlapping `&mut` views; `T: Send` makes moving those views across threads sound.
unsafe impl<T: Send> Sync for DisjointChunks<'_, T> {}

impl<'a, T> DisjointChunks<'a, T> {
    /// Splits `data` at the given boundaries: chunk `c` is `starts[c]..starts[c + 1]`, which
    /// must be non-decreasing and end at `data.len()`.
    pub fn new(data: &'a mut [T], boundaries: &[usize]) -> FfiResult<Self> {
        let count = boundaries.len().saturating_sub(1);
        if count > MAX_CHUNKS
            || boundaries.first() != Some(&0)
            || boundaries.last() != Some(&data.len())
            || boundaries.windows(2).any(|w| w[0] > w[1])
        {
            return Err(FfiError::internal(format!(
                "bad chunk boundaries {boundaries:?} for {} elements",
                data.len()
            )));
        }
        let mut starts = [0usize; MAX_CHUNKS + 1];
        starts[..boundaries.len()].copy_from_slice(boundaries);
        Ok(DisjointChunks {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            starts,
            count,
            taken: AtomicU64::new(0),
            _life: PhantomData,
        })
    }

    /// The number of chunks.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Chunk `c`, mutably; `None` if it does not exist or was already taken.
    #[allow(clippy::mut_from_ref)]
    pub fn take(&self, c: usize) -> Option<&mut [T]> {
        if c >= self.count {
            return None;
        }
        let bit = 1u64 << c;
        if self.taken.fetch_or(bit, Ordering::AcqRel) & bit != 0 {
            return None;
        }
        let (start, end) = (self.starts[c], self.starts[c + 1]);
        debug_assert!(end <= self.len);
        // SAFETY: `start..end` lies inside the slice (boundaries checked in `new`), chunks do
        // not overlap, and this chunk is handed out once (the bit set above), for `'a` at most.
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), end - start) })
    }
}

#[cfg(all(test, not(feature = "loom")))]
mod tests {
    use super::*;

    /// The loom models' scenarios on real threads, many times: tasks that start late (after
    /// `run` returned, some of them during the next run of the same pool), two loops running
    /// on one pool at once, and a pool whose slots are reused. A stress test samples the
    /// interleavings this machine happens to produce; the loom models below are the proof
    /// within their bounds, and this checks that the models' assumptions (a task runs once, on
    /// any thread, at any time) hold with real threads.
    #[test]
    fn late_tasks_and_reused_slots_on_real_threads() {
        let jobs = std::sync::Arc::new(ParallelJobs::new());
        let spawn = |task: sys::XLA_FFI_Task, data: *mut c_void| {
            let data = data as usize;
            std::thread::spawn(move || {
                if data.is_multiple_of(3) {
                    std::thread::yield_now();
                }
                // SAFETY: a task `run_on` scheduled, run once.
                unsafe { task(data as *mut c_void) }
            });
            true
        };
        std::thread::scope(|scope| {
            for owner in 0..2 {
                let jobs = std::sync::Arc::clone(&jobs);
                scope.spawn(move || {
                    for round in 0..300usize {
                        let chunks = 1 + (round + owner) % 7;
                        let counts: Vec<std::sync::atomic::AtomicUsize> =
                            (0..chunks).map(|_| Default::default()).collect();
                        let body = |c: usize| {
                            counts[c].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        };
                        jobs.run_on(chunks, 4, &body, spawn).unwrap();
                        for c in &counts {
                            assert_eq!(c.load(std::sync::atomic::Ordering::Relaxed), 1);
                        }
                    }
                });
            }
        });
    }

    #[test]
    fn chunks_are_taken_once() {
        let mut data = vec![0u32; 10];
        let chunks = DisjointChunks::new(&mut data, &[0, 3, 3, 10]).unwrap();
        assert_eq!(chunks.count(), 3);
        let a = chunks.take(0).unwrap();
        assert!(chunks.take(0).is_none());
        let c = chunks.take(2).unwrap();
        a.fill(1);
        c.fill(2);
        assert_eq!(chunks.take(1).unwrap().len(), 0);
        assert!(chunks.take(3).is_none());
        assert_eq!(data, [1, 1, 1, 2, 2, 2, 2, 2, 2, 2]);
        assert!(DisjointChunks::new(&mut data, &[0, 5, 4, 10]).is_err());
        assert!(DisjointChunks::new(&mut data, &[0, 5]).is_err());
    }
}

/// Model checking of the job slots with loom (`make loom`: feature `loom`, these tests only).
///
/// loom runs each model under every interleaving of its threads that a bounded number of
/// preemptions allows, with its models of the atomics, the fence, `Arc` and `UnsafeCell`; an
/// access to the loop body's cell that is not ordered after the write it reads (or a write
/// racing a read) fails the model, and so would a chunk run twice or not at all, a late task
/// running a body after `run` returned, or a slot reused while a task still holds it.
///
/// What it does not prove: interleavings beyond the preemption bound (three here; loom's
/// experience is that races show within two or three); more threads or chunks than modelled
/// (three threads, up to three chunks, two runs of one pool); the idle queue itself, which is
/// crossbeam's `ArrayQueue` in every build and modelled here as a bounded queue with atomic push
/// and pop; and XLA's real thread pool, modelled as threads that run each task once, at any
/// time. The workspace pools are a queue and counters around the same `ArrayQueue`, so there
/// is nothing of theirs for loom to model: `state::pool`'s threaded test is their stress test.
#[cfg(all(test, feature = "loom"))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicUsize as LoomUsize;

    struct SendPtr(*mut c_void);
    // SAFETY: the task contract lets `data` be used from any thread.
    unsafe impl Send for SendPtr {}

    /// XLA's thread pool as loom threads: each accepted task runs once, at a time loom picks.
    fn schedule_on_threads(task: sys::XLA_FFI_Task, data: *mut c_void) -> bool {
        let data = SendPtr(data);
        loom::thread::spawn(move || {
            let data = data;
            // SAFETY: `run_on` hands out tasks that may run once, on any thread, at any time.
            unsafe { task(data.0) }
        });
        true
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(f);
    }

    #[test]
    fn every_chunk_runs_once_and_no_task_sees_the_body_after_run_returns() {
        model(|| {
            let jobs = ParallelJobs::new();
            let counts: [LoomUsize; 3] = Default::default();
            let body = |chunk: usize| {
                counts[chunk].fetch_add(1, Ordering::Relaxed);
            };
            jobs.run_on(3, 3, &body, schedule_on_threads).unwrap();
            // `run_on` returned: every chunk ran exactly once, whoever ran it, and any task
            // still to start finds nothing to claim.
            for c in &counts {
                assert_eq!(c.load(Ordering::Relaxed), 1);
            }
        });
    }

    #[test]
    fn a_slot_is_reused_only_once_no_late_task_holds_it() {
        model(|| {
            let jobs = ParallelJobs::new();
            for _ in 0..2 {
                let counts: [LoomUsize; 2] = Default::default();
                let body = |chunk: usize| {
                    counts[chunk].fetch_add(1, Ordering::Relaxed);
                };
                jobs.run_on(2, 2, &body, schedule_on_threads).unwrap();
                for c in &counts {
                    assert_eq!(c.load(Ordering::Relaxed), 1);
                }
            }
        });
    }

    #[test]
    fn a_refused_task_leaves_the_work_to_the_caller() {
        model(|| {
            let jobs = ParallelJobs::new();
            let counts: [LoomUsize; 2] = Default::default();
            let body = |chunk: usize| {
                counts[chunk].fetch_add(1, Ordering::Relaxed);
            };
            jobs.run_on(2, 2, &body, |_, _| false).unwrap();
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
        });
    }

    #[test]
    fn disjoint_chunks_are_handed_out_once_across_threads() {
        model(|| {
            let data: &'static mut [u32] = Box::leak(vec![0u32; 4].into_boxed_slice());
            let chunks = Arc::new(DisjointChunks::new(data, &[0, 2, 4]).unwrap());
            let other = Arc::clone(&chunks);
            let thread = loom::thread::spawn(move || {
                let got: Vec<usize> = (0..2).filter(|&c| other.take(c).is_some()).collect();
                got
            });
            let mine: Vec<usize> = (0..2).filter(|&c| chunks.take(c).is_some()).collect();
            let theirs = thread.join().unwrap();
            let mut all = [mine, theirs].concat();
            all.sort();
            assert_eq!(all, [0, 1]);
        });
    }
}
