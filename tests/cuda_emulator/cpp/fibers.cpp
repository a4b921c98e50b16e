// The block scheduler: one fiber (ucontext) per CUDA thread, the fibers of a block run one at a
// time on the calling OS thread and switch only where CUDA threads synchronize (__syncthreads,
// warp shuffles). Runnable fibers are queued in an order shuffled by the launch's seed, so code
// that needs a barrier it lacks reads stale or poisoned data and gives wrong results; blocks
// run one after the other in a shuffled order, so a dependence on block order fails too.
//
// Switching: makecontext/swapcontext start a fiber; later switches use _setjmp/_longjmp, which
// do not save the signal mask (swapcontext makes a system call for it, most of the cost), except
// under the sanitizers, whose fiber support expects swapcontext.
//
// Sanitizers: under AddressSanitizer the stack switches are announced
// (__sanitizer_start/finish_switch_fiber). Under ThreadSanitizer every CUDA thread is a TSan
// fiber, switches carry no synchronization, and a barrier is a release by every arriving thread
// and an acquire by every leaving one: accesses of two CUDA threads not ordered by a barrier
// are reported as data races, whichever order the scheduler happened to pick.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <setjmp.h>
#include <ucontext.h>

#include <atomic>
#include <string>
#include <vector>

#include "cuda_shim.h"
#include "emulator.h"

#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#define EMU_TSAN 1
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#endif

#if defined(EMU_TRAFFIC)
// The traffic harness's recorder (traffic.cpp): which blocks of a grid to run, when a block
// starts and ends, and each thread's passage through a barrier or shuffle (the warp's lanes
// pass them together, so the accesses between two of them are the same instructions).
namespace emu {
bool traffic_run_block(uint64_t linear, uint64_t total);
void traffic_block_begin(int slot, int threads);
void traffic_block_switch(int slot);
void traffic_block_end(int slot);
void traffic_sync();
}  // namespace emu
#endif

extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

namespace emu {

thread_local std::atomic<const dim3*> t_thread_idx;
thread_local dim3 t_block_idx;
thread_local dim3 t_block_dim;
thread_local dim3 t_grid_dim;

namespace {

enum class State : int { Runnable, Barrier, Shuffle, Cluster, Exited, Failed };

struct Fiber {
  ucontext_t context;
  jmp_buf jump;
  bool started = false;
  dim3 tid;
  int warp = 0;
  int lane = 0;
  // Written by the fiber, read by the scheduler (atomics, so that TSan sees no race in the
  // emulator's own bookkeeping, only in the kernel's memory).
  std::atomic<int> state{(int)State::Runnable};
  std::atomic<int> line{0};
  std::atomic<int> lane_mask{0};
  std::atomic<uint64_t> bits{0};
  std::atomic<uint64_t> result{0};
  char* stack = nullptr;
#if EMU_TSAN
  void* tsan = nullptr;
#endif
#if EMU_ASAN
  void* asan_fake_stack = nullptr;
#endif
};

struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }
};

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define EMU_UCONTEXT_ONLY 1
constexpr size_t kStackBytes = 256 * 1024;
#else
constexpr size_t kStackBytes = 64 * 1024;
#endif
constexpr size_t kGuardBytes = 64;

// One block of the running cluster (a cluster of one without clusters): its fibers and their
// scheduler.
struct Run {
  const Kernel* kernel = nullptr;
  dim3 bid{0, 0, 0};
  int rank = 0;      // in the cluster
  int cluster = 1;   // blocks in the cluster
  int* cluster_token = nullptr;  // TSan's synchronization object for the cluster barrier
  std::vector<char> shared_copy;  // the block's static shared memory while another block runs
  int at_cluster = 0;
  int cluster_line = 0;
  const unsigned char* params = nullptr;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  jmp_buf scheduler_jump;
  int threads = 0;
  int live = 0;
  int at_barrier = 0;
  int barrier_line = 0;
  std::vector<int> warp_arrivals, warp_line, warp_live;
  std::vector<int> queue;
  size_t head = 0;
  Rng rng{0};
  bool failed = false;
  std::string error;
  unsigned char* dynamic = nullptr;
  size_t dynamic_bytes = 0;
  std::atomic<int> current{-1};
  int barrier_token = 0;  // TSan's synchronization object for the block barrier
  bool reusable = false;  // the fibers finished a block and can run the next (see fiber_main)
#if EMU_TSAN
  void* tsan_scheduler = nullptr;
#endif
#if EMU_ASAN
  void* asan_fake_stack = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
#endif
};

thread_local Run* t_run = nullptr;

std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

std::string where(const Fiber& f) {
  return format("block (%u,%u,%u) thread (%u,%u,%u)", t_block_idx.x, t_block_idx.y, t_block_idx.z,
                f.tid.x, f.tid.y, f.tid.z);
}

void fail_run(Run& run, const std::string& message) {
  if (!run.failed) {
    run.failed = true;
    run.error = message;
  }
}

// From a fiber back to the scheduler; returns when the scheduler resumes this fiber.
void to_scheduler(bool dying) {
  Run& run = *t_run;
  Fiber& f = run.fibers[run.current.load(std::memory_order_relaxed)];
#if EMU_TSAN
  // Synchronizing: the scheduler may read whatever the fiber wrote. The way back is not.
  __tsan_switch_to_fiber(run.tsan_scheduler, 0);
#endif
#if EMU_ASAN
  __sanitizer_start_switch_fiber(dying ? nullptr : &f.asan_fake_stack, run.scheduler_stack_bottom,
                                 run.scheduler_stack_size);
#else
  (void)dying;
#endif
#if EMU_UCONTEXT_ONLY
  swapcontext(&f.context, &run.scheduler);
#else
  if (!_setjmp(f.jump)) _longjmp(run.scheduler_jump, 1);
#endif
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(f.asan_fake_stack, nullptr, nullptr);
#endif
}

void fiber_main() {
  Run& run = *t_run;
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &run.scheduler_stack_bottom, &run.scheduler_stack_size);
#endif
  // The first switch into every fiber for a block only starts it (see begin_block): kernel code
  // runs from the second one on. A fiber that finished a block waits at the end of the loop
  // and takes the next block of the launch from the top, so later blocks cost no new contexts
  // (getcontext/makecontext/swapcontext make system calls for the signal mask: they were most
  // of the time of launches with many blocks). Under the sanitizers every block starts fresh
  // fibers instead (their fiber bookkeeping is per block).
  for (;;) {
    to_scheduler(false);
    run.kernel->invoke(run.params);
    run.fibers[run.current.load(std::memory_order_relaxed)].state.store((int)State::Exited, std::memory_order_relaxed);
    to_scheduler(true);
#if EMU_UCONTEXT_ONLY
    abort();  // never resumed
#endif
  }
}

void enqueue_shuffled(Run& run, std::vector<int>& ids) {
  run.rng.shuffle(ids);
  for (int id : ids) {
    run.fibers[id].state.store((int)State::Runnable, std::memory_order_relaxed);
    run.queue.push_back(id);
  }
}

void switch_to(Run& run, int id, bool synchronizing) {
  Fiber& f = run.fibers[id];
  run.current.store(id, std::memory_order_relaxed);
  t_thread_idx.store(&f.tid, std::memory_order_relaxed);
#if EMU_TSAN
  __tsan_switch_to_fiber(f.tsan, synchronizing ? 0 : 1 /* __tsan_switch_to_fiber_no_sync */);
#else
  (void)synchronizing;
#endif
#if EMU_ASAN
  __sanitizer_start_switch_fiber(&run.asan_fake_stack, f.stack, kStackBytes);
#endif
#if EMU_UCONTEXT_ONLY
  swapcontext(&run.scheduler, &f.context);
#else
  if (!_setjmp(run.scheduler_jump)) {
    if (f.started) {
      _longjmp(f.jump, 1);
    } else {
      f.started = true;
      ucontext_t unused;
      swapcontext(&unused, &f.context);  // the fiber comes back through scheduler_jump
    }
  }
#endif
#if EMU_ASAN
  __sanitizer_finish_switch_fiber(run.asan_fake_stack, nullptr, nullptr);
#endif
}

// What the scheduler does when fiber `id` comes back.
void arrived(Run& run, int id) {
  Fiber& f = run.fibers[id];
  const State st = (State)f.state.load(std::memory_order_relaxed);
  const int line = f.line.load(std::memory_order_relaxed);
  const int w = f.warp;
  switch (st) {
    case State::Runnable:
      fail_run(run, where(f) + ": came back to the scheduler without a reason");
      return;
    case State::Failed:
      return;  // fail() recorded the error
    case State::Exited:
      --run.live;
      --run.warp_live[w];
      if (run.at_barrier > 0)
        fail_run(run, where(f) + format(": exited while %d threads of its block wait at "
                                        "__syncthreads (line %d)",
                                        run.at_barrier, run.barrier_line));
      if (run.warp_arrivals[w] > 0)
        fail_run(run, where(f) + format(": exited while %d lanes of its warp wait at a shuffle "
                                        "(line %d)",
                                        run.warp_arrivals[w], run.warp_line[w]));
      if (run.at_cluster > 0)
        fail_run(run, where(f) + format(": exited while %d threads of its block wait at the "
                                        "cluster barrier (line %d)",
                                        run.at_cluster, run.cluster_line));
      return;
    case State::Cluster: {
      if (run.warp_arrivals[w] > 0 || run.at_barrier > 0) {
        fail_run(run, where(f) + format(": at the cluster barrier (line %d) while threads of its "
                                        "block wait at __syncthreads or a shuffle",
                                        line));
        return;
      }
      if (run.at_cluster == 0) {
        run.cluster_line = line;
      } else if (line != run.cluster_line) {
        fail_run(run, where(f) + format(": reached the cluster barrier at line %d while other "
                                        "threads of its block wait at the one at line %d",
                                        line, run.cluster_line));
        return;
      }
      ++run.at_cluster;  // released by the grid loop once every block of the cluster is here
      return;
    }
    case State::Barrier: {
      if (run.at_cluster > 0) {
        fail_run(run, where(f) + format(": at __syncthreads (line %d) while threads of its block "
                                        "wait at the cluster barrier (line %d)",
                                        line, run.cluster_line));
        return;
      }
      if (run.warp_arrivals[w] > 0)
        fail_run(run, where(f) + format(": at __syncthreads (line %d) while lanes of its warp "
                                        "wait at a shuffle (line %d)",
                                        line, run.warp_line[w]));
      if (run.at_barrier == 0) {
        run.barrier_line = line;
      } else if (line != run.barrier_line) {
        fail_run(run, where(f) + format(": reached __syncthreads at line %d while other threads "
                                        "of its block wait at the one at line %d",
                                        line, run.barrier_line));
        return;
      }
      if (++run.at_barrier == run.live) {
        std::vector<int> waiting;
        for (int i = 0; i < run.threads; ++i)
          if ((State)run.fibers[i].state.load(std::memory_order_relaxed) == State::Barrier)
            waiting.push_back(i);
        run.at_barrier = 0;
        ++run.barrier_token;
        enqueue_shuffled(run, waiting);
      }
      return;
    }
    case State::Shuffle: {
      if (run.at_barrier > 0 || run.at_cluster > 0) {
        for (int i = w * 32; i < w * 32 + 32 && i < run.threads; ++i) {
          const State other = (State)run.fibers[i].state.load(std::memory_order_relaxed);
          if (other == State::Barrier || other == State::Cluster) {
            fail_run(run, where(f) + format(": at a shuffle (line %d) while a lane of its warp "
                                            "waits at a barrier (line %d)",
                                            line, other == State::Barrier ? run.barrier_line
                                                                          : run.cluster_line));
            return;
          }
        }
      }
      if (run.warp_arrivals[w] == 0) {
        run.warp_line[w] = line;
      } else if (line != run.warp_line[w]) {
        fail_run(run, where(f) + format(": at the shuffle of line %d while lanes of its warp "
                                        "wait at the one of line %d (divergent warp)",
                                        line, run.warp_line[w]));
        return;
      }
      if (++run.warp_arrivals[w] == run.warp_live[w]) {
        if (run.warp_live[w] != 32) {
          fail_run(run, where(f) + format(": a full-mask shuffle (line %d) in a warp with %d "
                                          "live lanes",
                                          line, run.warp_live[w]));
          return;
        }
        std::vector<int> lanes;
        for (int l = 0; l < 32; ++l) {
          Fiber& g = run.fibers[w * 32 + l];
          const int src = l ^ g.lane_mask.load(std::memory_order_relaxed);
          const Fiber& from = run.fibers[w * 32 + (src < 32 ? src : l)];
          g.result.store(from.bits.load(std::memory_order_relaxed), std::memory_order_relaxed);
          lanes.push_back(w * 32 + l);
        }
        run.warp_arrivals[w] = 0;
        enqueue_shuffled(run, lanes);
      }
      return;
    }
  }
}

std::string pending(const Run& run) {
  std::string s = format("%d of %d threads live, %d at __syncthreads, %d at the cluster barrier",
                         run.live, run.threads, run.at_barrier, run.at_cluster);
  for (size_t w = 0; w < run.warp_arrivals.size(); ++w)
    if (run.warp_arrivals[w] > 0)
      s += format("; warp %zu: %d lanes at the shuffle of line %d", w, run.warp_arrivals[w],
                  run.warp_line[w]);
  return s;
}

void poison_shared() {
  char* start = __start_emu_shared;
  char* stop = __stop_emu_shared;
  if (start && stop && stop > start) memset(start, 0xff, (size_t)(stop - start));
}

// Makes block `bid` ready to run: fresh (or reused) fibers, poisoned shared memory.
void begin_block(Run& run, dim3 bid) {
  run.bid = bid;
  t_block_idx = bid;
#if defined(EMU_TRAFFIC)
  traffic_block_begin(run.rank, run.threads);
#endif
  poison_shared();  // a cluster's other blocks keep theirs in shared_copy (leave)
  memset(run.dynamic, 0xff, run.dynamic_bytes + kGuardBytes);
  run.live = run.threads;
  run.at_barrier = 0;
  run.at_cluster = 0;
  run.queue.clear();
  run.head = 0;
  for (size_t w = 0; w < run.warp_live.size(); ++w) {
    run.warp_arrivals[w] = 0;
    run.warp_live[w] = 0;
  }
  for (int i = 0; i < run.threads; ++i) {
    Fiber& f = run.fibers[i];
    ++run.warp_live[f.warp];
    f.state.store((int)State::Runnable, std::memory_order_relaxed);
    if (run.reusable) continue;  // waiting at the end of fiber_main's loop (see there)
    f.started = false;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
#if EMU_TSAN
    f.tsan = __tsan_create_fiber(0);
#endif
  }
  // Start every fiber with a synchronizing switch (it sees the poisoned memory and the
  // parameters); from here on switches do not synchronize.
  for (int i = 0; i < run.threads; ++i) switch_to(run, i, true);
  std::vector<int> all(run.threads);
  for (int i = 0; i < run.threads; ++i) all[i] = i;
  enqueue_shuffled(run, all);
}

// Runs the block's runnable fibers until none is: the block exited, waits at the cluster
// barrier (every live thread there), or is deadlocked (an error).
void step_block(Run& run) {
  while (!run.failed) {
    if (run.head == run.queue.size()) {
      if (run.live > 0 && run.at_cluster != run.live)
        fail_run(run, "deadlock: " + pending(run));
      break;
    }
    const int id = run.queue[run.head++];
    switch_to(run, id, false);
    arrived(run, id);
  }
}

// Lets the block's threads past the cluster barrier.
void release_cluster(Run& run) {
  std::vector<int> waiting;
  for (int i = 0; i < run.threads; ++i)
    if ((State)run.fibers[i].state.load(std::memory_order_relaxed) == State::Cluster)
      waiting.push_back(i);
  run.at_cluster = 0;
  enqueue_shuffled(run, waiting);
}

// Checks the block's guard bytes and lets its fibers take the next block.
void end_block(Run& run) {
#if !EMU_UCONTEXT_ONLY
  run.reusable = !run.failed;  // every fiber exited normally: each waits for the next block
#endif
  for (size_t i = 0; i < run.dynamic_bytes + kGuardBytes; ++i)
    if (i >= run.dynamic_bytes && run.dynamic[i] != 0xff) {
      fail_run(run, format("block (%u,%u,%u) wrote past the end of its %zu bytes of dynamic shared "
                           "memory (byte %zu)",
                           run.bid.x, run.bid.y, run.bid.z, run.dynamic_bytes, i));
      break;
    }
#if EMU_TSAN
  for (int i = 0; i < run.threads; ++i) __tsan_destroy_fiber(run.fibers[i].tsan);
#endif
#if defined(EMU_TRAFFIC)
  traffic_block_end(run.rank);
#endif
}

// Makes `run` the running block of its cluster (its static shared memory in place), and back.
// Written only when they change (a cluster's other block): without clusters the scheduler never
// writes what the running fibers read between their switches (ThreadSanitizer, which sees no
// synchronization in those switches, would report it; its sweep has no cluster launches).
void enter(Run& run) {
  if (t_run != &run) t_run = &run;
  const dim3& b = t_block_idx;
  if (b.x != run.bid.x || b.y != run.bid.y || b.z != run.bid.z) t_block_idx = run.bid;
  if (run.cluster > 1) {
    char* start = __start_emu_shared;
    if (start) memcpy(start, run.shared_copy.data(), run.shared_copy.size());
  }
#if defined(EMU_TRAFFIC)
  traffic_block_switch(run.rank);
#endif
}
void leave(Run& run) {
  if (run.cluster > 1) {
    const char* start = __start_emu_shared;
    if (start) memcpy(run.shared_copy.data(), start, run.shared_copy.size());
  }
}

// Runs the blocks of one cluster (`runs`, begun) to completion: each in turn, in a shuffled
// order, until all its threads exit or wait at the cluster barrier; when every block waits
// there, all go on. A block that exits while others wait is an error (as a thread that exits
// while its block waits at __syncthreads).
void run_cluster(std::vector<Run>& runs, Rng& rng) {
  std::vector<int> order(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) order[r] = (int)r;
  for (;;) {
    rng.shuffle(order);
    for (int r : order) {
      Run& run = runs[r];
      if (run.live == 0) continue;
      enter(run);
      step_block(run);
      leave(run);
    }
    int done = 0, waiting = 0, line = 0;
    for (Run& run : runs) {
      if (run.failed) return;
      if (run.live == 0) {
        ++done;
      } else {
        ++waiting;
        line = run.cluster_line;
      }
    }
    if (waiting == 0) return;
    if (done > 0) {
      for (Run& run : runs)
        if (run.live == 0)
          fail_run(run, format("block (%u,%u,%u) exited while %d blocks of its cluster wait at the "
                               "cluster barrier (line %d)",
                               run.bid.x, run.bid.y, run.bid.z, waiting, line));
      return;
    }
    ++*runs[0].cluster_token;
    for (Run& run : runs) release_cluster(run);
  }
}

uint64_t gcd(uint64_t a, uint64_t b) {
  while (b) {
    const uint64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

}  // namespace

[[noreturn]] void fail(const char* what, int line) {
  Run& run = *t_run;
  Fiber& f = run.fibers[run.current.load(std::memory_order_relaxed)];
  fail_run(run, where(f) + format(": %s (line %d)", what, line));
  f.state.store((int)State::Failed, std::memory_order_relaxed);
  for (;;) to_scheduler(true);
}

namespace {

// The running thread waits at a barrier (`state`: the block's or the cluster's) until the
// scheduler lets its block, or its cluster, past; `token` is TSan's synchronization object for
// that barrier (a release on arrival, an acquire on leaving).
void wait_at(State state, int* token, int line) {
  Run& run = *t_run;
  Fiber& f = run.fibers[run.current.load(std::memory_order_relaxed)];
#if EMU_TSAN
  __tsan_release(token);
#else
  (void)token;
#endif
#if defined(EMU_TRAFFIC)
  traffic_sync();
#endif
  f.line.store(line, std::memory_order_relaxed);
  f.state.store((int)state, std::memory_order_relaxed);
  to_scheduler(false);
#if EMU_TSAN
  __tsan_acquire(token);
#endif
}

}  // namespace

void sync_block(int line) { wait_at(State::Barrier, &t_run->barrier_token, line); }

uint64_t exchange_xor(unsigned mask, uint64_t bits, int lane_mask, int line) {
  if (mask != 0xffffffffu) fail("__shfl_xor_sync without the full mask", line);
  Run& run = *t_run;
  Fiber& f = run.fibers[run.current.load(std::memory_order_relaxed)];
#if defined(EMU_TRAFFIC)
  traffic_sync();
#endif
  f.bits.store(bits, std::memory_order_relaxed);
  f.lane_mask.store(lane_mask, std::memory_order_relaxed);
  f.line.store(line, std::memory_order_relaxed);
  f.state.store((int)State::Shuffle, std::memory_order_relaxed);
  to_scheduler(false);
  return f.result.load(std::memory_order_relaxed);
}

unsigned char* dynamic_shared() { return t_run->dynamic; }

int cluster_rank() { return t_run->rank; }
int cluster_blocks() { return t_run->cluster; }

void sync_cluster(int line) { wait_at(State::Cluster, t_run->cluster_token, line); }

}  // namespace emu

extern "C" int emu_run_grid(const emu::Kernel* kernel, emu::Dim grid, emu::Dim block,
                            unsigned cluster, unsigned dynamic_bytes, const unsigned char* params,
                            uint64_t seed, char* message, size_t capacity) {
  using namespace emu;
  if (cluster == 0 || grid.x % cluster != 0) {
    snprintf(message, capacity, "a cluster of %u blocks in a grid of %u along x", cluster, grid.x);
    return -1;
  }
  const int threads = (int)(block.x * block.y * block.z);
  const int warps = (threads + 31) / 32;
  // Stacks are kept for the next launch on this OS thread (touching fresh ones page by page
  // would cost more than the kernels).
  struct Stacks {
    std::vector<char*> v;
    ~Stacks() {
      for (char* s : v) free(s);
    }
  };
  thread_local Stacks cache;
  std::vector<char*>& stacks = cache.v;
  while (stacks.size() < (size_t)threads * cluster) {
    char* stack = (char*)malloc(kStackBytes);
    if (!stack) abort();
    stacks.push_back(stack);
  }
  const size_t shared_bytes =
      __start_emu_shared && __stop_emu_shared ? (size_t)(__stop_emu_shared - __start_emu_shared) : 0;
  int cluster_token = 0;
  std::vector<Run> runs(cluster);
  std::vector<std::vector<unsigned char>> dynamic(cluster);
  for (unsigned r = 0; r < cluster; ++r) {
    Run& run = runs[r];
    run.kernel = kernel;
    run.params = params;
    run.rng.s = seed + r * 0x9e3779b97f4a7c15ull;
    run.threads = threads;
    run.rank = (int)r;
    run.cluster = (int)cluster;
    run.cluster_token = &cluster_token;
    if (cluster > 1) run.shared_copy.assign(shared_bytes, (char)0xff);
    run.warp_arrivals.assign(warps, 0);
    run.warp_line.assign(warps, 0);
    run.warp_live.assign(warps, 0);
    run.fibers = std::vector<Fiber>(threads);
    for (int i = 0; i < threads; ++i) {
      Fiber& f = run.fibers[i];
      f.tid = dim3{(unsigned)i % block.x, (unsigned)i / block.x % block.y,
                   (unsigned)i / (block.x * block.y)};
      f.warp = i / 32;
      f.lane = i % 32;
      f.stack = stacks[r * threads + i];
    }
    run.dynamic_bytes = dynamic_bytes;
    dynamic[r].resize(dynamic_bytes + kGuardBytes);
    run.dynamic = dynamic[r].data();
  }
  t_block_dim = dim3{block.x, block.y, block.z};
  t_grid_dim = dim3{grid.x, grid.y, grid.z};
  Run* outer = t_run;
#if EMU_TSAN
  for (Run& run : runs) run.tsan_scheduler = __tsan_get_current_fiber();
#endif
  Rng rng{seed ^ 0x5851f42d4c957f2dull};
  auto failed = [&] {
    for (Run& run : runs)
      if (run.failed) return true;
    return false;
  };
  // Clusters in the order i -> (a * i + b) mod total, a coprime to total: a permutation of any
  // size without a table; a cluster's blocks are consecutive along x.
  const uint64_t per_row = grid.x / cluster;
  const uint64_t total = (uint64_t)per_row * grid.y * grid.z;
  const uint64_t blocks = (uint64_t)grid.x * grid.y * grid.z;
  uint64_t a = 1 + rng.below(total > 1 ? total - 1 : 1);
  while (gcd(a, total) != 1) ++a;
  const uint64_t b = rng.below(total);
  for (uint64_t i = 0; i < total && !failed(); ++i) {
    const uint64_t k = (uint64_t)(((unsigned __int128)a * i + b) % total);
    const unsigned x0 = (unsigned)(k % per_row) * cluster;
    const unsigned y = (unsigned)(k / per_row % grid.y), z = (unsigned)(k / (per_row * grid.y));
#if defined(EMU_TRAFFIC)
    bool any = false;
    for (unsigned r = 0; r < cluster; ++r)
      any |= traffic_run_block(x0 + r + (uint64_t)y * grid.x + (uint64_t)z * grid.x * grid.y,
                               blocks);
    if (!any) continue;
#else
    (void)blocks;
#endif
    for (unsigned r = 0; r < cluster; ++r) {
      t_run = &runs[r];
      begin_block(runs[r], dim3{x0 + r, y, z});
      leave(runs[r]);
    }
    run_cluster(runs, rng);
    for (Run& run : runs) {
      enter(run);
      end_block(run);
    }
  }
  t_run = outer;
  for (Run& run : runs)
    if (run.failed) {
      snprintf(message, capacity, "%s", run.error.c_str());
      return -1;
    }
  return 0;
}
