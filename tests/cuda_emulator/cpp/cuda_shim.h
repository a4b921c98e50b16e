// The CUDA built-ins the RMS norm kernels use, for compiling rmsnorm.cu as host C++ (tests only).
//
// Force-included before the kernel source. One CUDA thread is one fiber; the fibers of a block
// run one at a time on the launching OS thread and switch only at __syncthreads and warp
// shuffles (fibers.cpp), in a shuffled order, so a missing barrier shows as a wrong result.
//
// What is emulated: threadIdx/blockIdx/blockDim/gridDim, __syncthreads (a block barrier that
// fails when threads arrive from different call sites or a thread exits while others wait),
// __shfl_xor_sync (an exchange that requires a full mask and all 32 lanes at the same call
// site), static __shared__ storage per block (poisoned with NaN bytes before every block),
// dynamic shared memory, thread block clusters (a cluster's blocks run together, switching at
// the cluster barrier, each with its own copy of the static shared memory), uint2/uint4, __ldg (alignment checked), the bit casts, and
// __launch_bounds__ (read into the kernel table by build.rs). What is not: the two inline-PTX
// half conversions (rmsnorm.cu uses emu_half_to_float / emu_float_to_half_rn instead, tested
// against the `half` crate bit for bit), FMA contraction (the host code has none), memory
// ordering between blocks (blocks run one after the other, in a shuffled order).
#pragma once

#include <math.h>  // the C++ wrapper: float overloads of sqrt in the global namespace
#include <stdint.h>
#include <string.h>

#include <atomic>

namespace emu {

struct dim3 {
  unsigned int x, y, z;
};

// The running fiber's index (an atomic pointer: the scheduler switches fibers without telling
// ThreadSanitizer, and a plain variable it rewrites would look like a race).
extern thread_local std::atomic<const dim3*> t_thread_idx;
extern thread_local dim3 t_block_idx;
extern thread_local dim3 t_block_dim;
extern thread_local dim3 t_grid_dim;

[[noreturn]] void fail(const char* what, int line);
void sync_block(int line);
// Deposits `bits` (up to 8 bytes) for lane `lane ^ lane_mask` to read, waits for the warp.
uint64_t exchange_xor(unsigned mask, uint64_t bits, int lane_mask, int line);
unsigned char* dynamic_shared();
// Thread block clusters (emu_run_grid's `cluster`: consecutive blockIdx.x, 1 when the launch
// has none): the block's rank in its cluster, the cluster's blocks, and the cluster barrier,
// where every thread of the cluster's blocks waits for all the others (the emulator switches
// between the cluster's blocks there, and only there).
int cluster_rank();
int cluster_blocks();
void sync_cluster(int line);

template <typename T>
inline T shfl_xor_sync(unsigned mask, T v, int lane_mask, int line) {
  static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  bits = exchange_xor(mask, bits, lane_mask, line);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}

template <typename T>
inline T ldg(const T* p, int line) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) fail("misaligned __ldg", line);
  return *p;
}

}  // namespace emu

#define threadIdx (*::emu::t_thread_idx.load(std::memory_order_relaxed))
#define blockIdx (::emu::t_block_idx)
#define blockDim (::emu::t_block_dim)
#define gridDim (::emu::t_grid_dim)

#define __global__
#define __device__
#define __forceinline__ inline
#define __align__(n) alignas(n)
// Static shared memory: one copy per process, in a section of its own so that the launcher can
// poison it before every block (blocks run one at a time).
#define __shared__ __attribute__((section("emu_shared"))) static
#if defined(EMU_EXPAND)
// build.rs preprocesses the kernels with EMU_EXPAND to list them: the bounds stay in the text.
#define __launch_bounds__(...) EMU_LAUNCH_BOUNDS(__VA_ARGS__)
#else
#define __launch_bounds__(...)
#endif

#if defined(EMU_TRAFFIC)
// The traffic harness (traffic.cpp, `make gpu-traffic`): every global access the kernel source
// marks with EMU_GLOBAL is recorded with its address, size and width (its type's alignment, at
// most 16 bytes: the widest load or store a thread issues). Not defined in the tests' builds,
// where EMU_GLOBAL expands to nothing.
namespace emu {
void traffic_access(const void* p, unsigned bytes, unsigned width, bool store, int line);
void traffic_step();
}
// An iteration of one of rmsnorm.cu's streaming loops: the row loads a thread issues from one
// iteration to the next are what it has in flight there.
#define EMU_STEP() ::emu::traffic_step()
#define EMU_GLOBAL(p, store)                                                             \
  ::emu::traffic_access((p), (unsigned)sizeof(*(p)),                                   \
                        (unsigned)(alignof(decltype(*(p))) < 16 ? alignof(decltype(*(p))) : 16), \
                        (store), __LINE__)
#endif

#define __syncthreads() ::emu::sync_block(__LINE__)
#define __shfl_xor_sync(mask, v, lane_mask) ::emu::shfl_xor_sync((mask), (v), (lane_mask), __LINE__)
#define __ldg(p) ::emu::ldg((p), __LINE__)

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};

inline float __uint_as_float(unsigned int u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  memcpy(&u, &f, 4);
  return u;
}
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }

// Host equivalents of `cvt.f32.f16` (exact) and `cvt.rn.f16.f32` (round to nearest even;
// overflow to infinity), bit for bit as the `half` crate converts on the CPU path, NaN included
// (quieted, with the payload's top bits; the device's NaN payloads may differ).
inline float emu_half_to_float(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16;
  const unsigned exp = (h >> 10) & 0x1fu;
  unsigned mant = h & 0x3ffu;
  unsigned bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u);  // NaN comes out quiet
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((unsigned)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  return __uint_as_float(bits);
}

inline unsigned short emu_float_to_half_rn(float f) {
  const unsigned x = __float_as_uint(f);
  const unsigned sign = (x >> 16) & 0x8000u;
  const unsigned exp = (x >> 23) & 0xffu;
  const unsigned mant = x & 0x7fffffu;
  if (exp == 0xff) {
    if (mant == 0) return (unsigned short)(sign | 0x7c00u);
    return (unsigned short)(sign | 0x7e00u | (mant >> 13));
  }
  const int e = (int)exp - 127 + 15;
  if (e >= 0x1f) return (unsigned short)(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return (unsigned short)sign;  // below half the smallest subnormal
    const unsigned m = mant | 0x800000u;
    const int shift = 14 - e;
    unsigned half = m >> shift;
    const unsigned rest = m & ((1u << shift) - 1);
    const unsigned halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return (unsigned short)(sign | half);
  }
  unsigned half = ((unsigned)e << 10) | (mant >> 13);
  const unsigned rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into infinity
  return (unsigned short)(sign | half);
}

inline unsigned char* emu_dynamic_shared() { return ::emu::dynamic_shared(); }
inline int emu_cluster_rank() { return ::emu::cluster_rank(); }
inline int emu_cluster_blocks() { return ::emu::cluster_blocks(); }
#define emu_cluster_sync() ::emu::sync_cluster(__LINE__)
