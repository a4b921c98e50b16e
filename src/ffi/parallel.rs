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

use std::cell::UnsafeCell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam::queue::ArrayQueue;

use super::context::Context;
use super::error::{FfiError, FfiResult};

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
// it done, during which the owner waits. The pointee is `Sync`.
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
            let body = unsafe { (*self.body.get()).expect("a claimed chunk has a body") };
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
    idle: ArrayQueue<Arc<JobSlot>>,
}

impl Default for ParallelJobs {
    fn default() -> Self {
        Self::new()
    }
}

impl ParallelJobs {
    pub fn new() -> Self {
        ParallelJobs {
            idle: ArrayQueue::new(64),
        }
    }

    /// A slot no task holds any more, or a new one.
    fn checkout(&self) -> Arc<JobSlot> {
        for _ in 0..self.idle.len() {
            match self.idle.pop() {
                Some(slot) if Arc::strong_count(&slot) == 1 => {
                    // Pairs with the release in the last task's `Arc` drop: everything that
                    // task did to the slot happens before we reset it.
                    std::sync::atomic::fence(Ordering::Acquire);
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
        unsafe { *slot.body.get() = Some(erased) };
        slot.total.store(chunks, Ordering::Release);

        for _ in 1..workers.min(chunks) {
            let data = Arc::into_raw(Arc::clone(&slot)).cast_mut().cast::<c_void>();
            // SAFETY: `run_task` takes back the `Arc` leaked above and may run at any time on
            // any thread; the slot stays alive through that `Arc`.
            if unsafe { ctx.schedule_raw(run_task, data) }.is_err() {
                // SAFETY: the pool refused the task, so the `Arc` is still ours.
                drop(unsafe { Arc::from_raw(data.cast::<JobSlot>()) });
                break;
            }
        }
        slot.work();
        let mut spins = 0u32;
        while slot.done.load(Ordering::Acquire) < chunks {
            spins += 1;
            if spins < 256 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every chunk is done: no task will read `body` again.
        unsafe { *slot.body.get() = None };
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

#[cfg(test)]
mod tests {
    use super::*;

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
