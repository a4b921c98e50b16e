//! Workspace pools: scratch buffers that many concurrent executions of one state share.
//!
//! XLA may run the execute stage of one state on several threads at once (one per device for
//! sharded inputs, or Python threads running the same executable), so a state cannot hold a
//! single scratch buffer. A pool hands each execution its own buffer and takes it back after:
//! a lock-free bounded queue (`crossbeam::queue::ArrayQueue`) of idle buffers. A checkout
//! allocates only when every buffer is in use, so after warm-up (as many buffers as the most
//! executions ever in flight at once) executions allocate nothing. Every allocation and the
//! bytes held are counted in the live-state registry.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam::queue::ArrayQueue;

use super::registry::workspace_changed;

/// How many idle buffers a pool keeps by default; more are freed when returned.
pub const DEFAULT_POOL_CAPACITY: usize = 256;

/// A pool of equally sized scratch buffers of `T`.
pub struct WorkspacePool<T: Copy + Default + Send> {
    idle: ArrayQueue<Box<[T]>>,
    len: usize,
    allocations: AtomicU64,
    held: AtomicU64,
}

impl<T: Copy + Default + Send> WorkspacePool<T> {
    /// A pool of buffers of `len` elements, keeping at most `capacity` idle ones.
    pub fn new(len: usize, capacity: usize) -> Self {
        WorkspacePool {
            idle: ArrayQueue::new(capacity.max(1)),
            len,
            allocations: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// Elements per buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether buffers have no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn bytes(&self) -> i64 {
        (self.len * std::mem::size_of::<T>()) as i64
    }

    fn allocate(&self) -> Box<[T]> {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        self.held.fetch_add(1, Ordering::Relaxed);
        workspace_changed(self.bytes(), 1);
        vec![T::default(); self.len].into_boxed_slice()
    }

    fn free(&self, buffer: Box<[T]>) {
        self.held.fetch_sub(1, Ordering::Relaxed);
        workspace_changed(-self.bytes(), 0);
        drop(buffer);
    }

    /// Allocates `count` idle buffers ahead of time (e.g. one per expected thread).
    pub fn prefill(&self, count: usize) {
        for _ in 0..count {
            if let Err(buffer) = self.idle.push(self.allocate()) {
                self.free(buffer);
                break;
            }
        }
    }

    /// A buffer for the caller's exclusive use until the guard drops. Its contents are
    /// whatever the last user left.
    pub fn checkout(&self) -> Workspace<'_, T> {
        let buffer = self.idle.pop().unwrap_or_else(|| self.allocate());
        Workspace {
            buffer: Some(buffer),
            pool: self,
        }
    }

    /// Buffers this pool has allocated so far.
    pub fn allocations(&self) -> u64 {
        self.allocations.load(Ordering::Relaxed)
    }

    /// Bytes of the buffers this pool holds now, idle or checked out.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Relaxed) * self.bytes() as u64
    }

    /// Buffers idle in the pool now.
    pub fn idle(&self) -> usize {
        self.idle.len()
    }
}

impl<T: Copy + Default + Send> Drop for WorkspacePool<T> {
    fn drop(&mut self) {
        while let Some(buffer) = self.idle.pop() {
            self.free(buffer);
        }
    }
}

/// A checked-out buffer; returns to its pool on drop.
pub struct Workspace<'p, T: Copy + Default + Send> {
    buffer: Option<Box<[T]>>,
    pool: &'p WorkspacePool<T>,
}

impl<T: Copy + Default + Send> Deref for Workspace<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.buffer.as_deref().unwrap_or(&[])
    }
}

impl<T: Copy + Default + Send> DerefMut for Workspace<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.buffer.as_deref_mut().unwrap_or(&mut [])
    }
}

impl<T: Copy + Default + Send> Drop for Workspace<'_, T> {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            if let Err(buffer) = self.pool.idle.push(buffer) {
                self.pool.free(buffer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Barrier;

    #[test]
    fn reuses_buffers_after_warm_up() {
        let pool = WorkspacePool::<f32>::new(16, 8);
        for _ in 0..100 {
            let mut w = pool.checkout();
            w[0] += 1.0;
        }
        assert_eq!(pool.allocations(), 1);
        let a = pool.checkout();
        let b = pool.checkout();
        assert_eq!(pool.allocations(), 2);
        drop((a, b));
        assert_eq!(pool.idle(), 2);
    }

    /// The pool's stress test. It checks, on every run: no buffer is ever held by two threads
    /// at once (each stamps its buffer, yields, and finds its stamp intact), the pool allocates
    /// no more than the most buffers ever out at once plus its capacity, and the accounting
    /// (allocations, bytes held, idle buffers) comes back to exact values.
    ///
    /// What it cannot prove: it samples the interleavings this machine's scheduler produces
    /// (two cores), so a race that needs a rarer one can go unseen; a data race that leaves the
    /// values intact is invisible to it (ThreadSanitizer would see it; Rust's cannot run here);
    /// and the queue's own memory ordering is crossbeam's `ArrayQueue`, proven by crossbeam's
    /// tests, not here. The pool adds only counters around that queue, so there is no protocol
    /// of its own for a model checker (the job slots of `ffi::parallel` have one, and loom
    /// checks it).
    #[test]
    fn stress_checkouts_beyond_the_capacity_from_many_threads() {
        let threads = 8u64;
        // Capacity 16 keeps every buffer (at most 2 per thread are out at once); capacity 3
        // frees the overflow on return, thousands of times.
        for capacity in [16usize, 3] {
            let pool = WorkspacePool::<u64>::new(64, capacity);
            std::thread::scope(|s| {
                for t in 0..threads {
                    let pool = &pool;
                    s.spawn(move || {
                        for round in 0..2000u64 {
                            let stamp = t << 32 | round;
                            let mut a = pool.checkout();
                            a.fill(stamp);
                            // Sometimes hold two at once.
                            let b = (round % 5 == 0).then(|| {
                                let mut b = pool.checkout();
                                b.fill(!stamp);
                                b
                            });
                            std::thread::yield_now();
                            assert!(a.iter().all(|&v| v == stamp), "a buffer held twice");
                            if let Some(b) = b {
                                assert!(b.iter().all(|&v| v == !stamp), "a buffer held twice");
                            }
                        }
                    });
                }
            });
            let most_out = 2 * threads as usize;
            if capacity >= most_out {
                // Every returned buffer was kept: no more allocations than were ever out.
                assert!(
                    pool.allocations() as usize <= most_out,
                    "{}",
                    pool.allocations()
                );
            }
            let idle = pool.idle();
            assert!(idle <= capacity && idle as u64 <= pool.allocations());
            assert_eq!(
                pool.held_bytes(),
                idle as u64 * 64 * 8,
                "freed buffers count as freed"
            );
        }
    }

    #[test]
    fn concurrent_checkouts_get_distinct_buffers() {
        let pool = WorkspacePool::<u64>::new(1024, 16);
        let threads = 8;
        let barrier = Barrier::new(threads);
        std::thread::scope(|s| {
            for t in 0..threads {
                let (pool, barrier) = (&pool, &barrier);
                s.spawn(move || {
                    for round in 0..200u64 {
                        let mut w = pool.checkout();
                        w.fill(t as u64 * 1000 + round);
                        if round == 0 {
                            barrier.wait();
                        }
                        std::thread::yield_now();
                        assert!(w.iter().all(|&v| v == t as u64 * 1000 + round));
                    }
                });
            }
        });
        assert!(pool.allocations() as usize >= threads);
        assert!(pool.allocations() as usize <= threads + 8);
        assert_eq!(pool.idle() as u64, pool.allocations());
    }

    #[test]
    fn bytes_are_counted_and_released() {
        let pool = WorkspacePool::<f64>::new(1000, 1);
        pool.prefill(1);
        assert_eq!(pool.held_bytes(), 8000);
        let a = pool.checkout();
        let b = pool.checkout();
        assert_eq!(pool.held_bytes(), 16000);
        drop((a, b)); // one goes back, the other is freed (capacity 1)
        assert_eq!(pool.held_bytes(), 8000);
        assert_eq!(pool.idle(), 1);
    }
}
