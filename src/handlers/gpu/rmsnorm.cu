// RMS norm kernels for NVIDIA GPUs, compiled at run time by NVRTC (see kernels.rs).
//
// The same file also compiles as host C++ for the CPU emulator of the tests
// (tests/cuda_emulator): the places that NVRTC alone can take (the dynamic shared memory
// declaration, the inline-PTX half conversions, the bfloat16 pair rounding and high-half mask,
// and `opaque`'s empty move) sit behind `__CUDACC_RTC__`, which NVRTC defines, with host
// equivalents otherwise (the same bits: the emulated tests run those).
//
// Deliberately header-free: bfloat16 and float16 are carried as raw 16-bit patterns and
// converted with bit arithmetic / PTX `cvt`, so NVRTC needs no CUDA include directory at run
// time (a `jax[cuda12]` or `jax[cuda13]` install ships the headers in different places, and a
// driver-only system ships none).
//
// Layout of the work:
// - A *team* of `team` threads (a power of two, 1..1024 in the forward, 32..512 in the backward,
//   uniform per launch) owns one row at a time; a block holds blockDim.x / team teams, so short
//   rows get several rows per block (and, in the forward, per warp: a warp's 16-byte accesses
//   then cover several whole rows, and rows of 64 bfloat16 keep every lane busy) and long rows
//   a whole block per row.
// - Each thread caches up to VPT vectors of its row in registers (16-byte loads when VEC > 1),
//   so x (and dy) are read from DRAM exactly once; rows too long for the cache take a streaming
//   path that re-reads them (from L2, in practice).
// - Every loop over rows runs the same number of iterations in every thread of a block (teams
//   without a row compute nothing but still reach each __syncthreads).
// - Backward: each block owns a contiguous chunk of rows of one weight group and accumulates the
//   weight gradient of those rows (see "Sums" for how), writing one partial row per block. A
//   finalize kernel adds each group's partial rows in block order: the weight gradient is
//   bitwise reproducible for a launch shape.
// - Batched (vmapped) weights: rows come in `groups` consecutive groups of `rows_per_group`, each
//   with its own weight row (and weight-gradient row). One launch covers every group: the
//   forward picks the weight row from the row index, the backward gives each group
//   `blocks_per_group` blocks, and the finalize one grid column block per group and 32 columns.
// - Fused residual add (rmsnorm_residual_fwd): the forward of h = x + residual, h rounded to x's
//   dtype as XLA rounds `x + residual` (half precision through float32, whose sum of two half
//   values is exact or, far apart in magnitude, rounds below half a unit of the result: the
//   bits of the CPU bundle), in one pass that reads x and the residual and writes h and y.
//
// Sums. Elements are widened to the accumulator type A (float32, float64 for float64 input) on
// load and narrowed on store. Every sum that runs along a row (the forward's sum of squares,
// the backward's dot product) or over rows (the weight gradient) is taken in two levels, so its
// error does not grow with the row length or the number of rows (one float32 accumulator along
// a row or over the rows of a block drifted by tens of eps at 2^20 terms):
// - each thread sums at most FOLD_ELEMS of its elements in A (its cached vectors, or that many
//   of the streaming path's), or one column's terms of at most FOLD_ROWS rows, then adds that
//   partial into a Wide<A>: float64 for float32 partials (its rounding is 2^-29 of theirs), a
//   compensated float64 pair (TwoSum) for float64 ones;
// - the team's tree (warp shuffles, then one slot per warp) and the weight gradient's partial
//   rows (8 bytes per column, 16 for float64 input) and finalize are Wide too, except the
//   narrow partial rows of blocks with one team and at most FOLD_ROWS rows: their sums never
//   left A, and a float32 row holds them exactly (4 bytes per column, the same finalize bits);
// - rstd = 1 / sqrt(sum / n + eps) and the backward's coefficient are taken in float64 and
//   rounded once to A (the CPU bundle's math.rs does the same).
// Why this split on a GPU: the per-element work stays one float32 FMA, as in a plain float32
// kernel (a float64 conversion and add per element would run at the float64 rate, half of
// float32's on sm_80/sm_90 data-centre parts but 1/64 on consumer parts, and cost more than the
// loads), while the float64 work is per thread per 32 elements or 8 rows plus the per-row tree
// (log2(team) shuffled adds and one division and square root per row), which the loads of the
// row hide even on the parts with slow float64.

typedef unsigned short u16;
typedef long long i64;

// EMU_GLOBAL(p, store): one access of a thread to global memory at `p` (`*p`'s size and
// alignment: the instruction's width). Nothing on the device and in the emulated tests; the
// traffic harness (tests/cuda_emulator/traffic.py, built with EMU_TRAFFIC) records each one to
// count the bytes, the 32-byte sectors per warp access and the widths of every kernel.
#if !defined(EMU_GLOBAL)
#define EMU_GLOBAL(p, store)
#endif
// EMU_STEP(): a thread starts an iteration of a streaming loop. Nothing on the device and in the
// emulated tests; the traffic harness measures the row loads a thread issues per iteration:
// what it has in flight on the streaming paths (the SASS issues them before their first use).
#if !defined(EMU_STEP)
#define EMU_STEP()
#endif

// Kernel variants (src/handlers/gpu/variant.rs, RMSNORM_FFI_GPU_PLAN) define FWD_VPT,
// FWD_MAX_THREADS, FWD_MIN_BLOCKS and FWD_WEIGHT_EARLY before this file; without them, the
// defaults below.
#if !defined(FWD_VPT)
#define FWD_VPT 4
#endif
#if !defined(FWD_WEIGHT_EARLY)
#define FWD_WEIGHT_EARLY 0
#endif
#if !defined(FWD_MAX_THREADS)
#define FWD_MAX_THREADS 1024
#endif
#if defined(FWD_MIN_BLOCKS)
#define FWD_BOUNDS __launch_bounds__(FWD_MAX_THREADS, FWD_MIN_BLOCKS)
#else
#define FWD_BOUNDS __launch_bounds__(FWD_MAX_THREADS)
#endif

struct bf16_t { u16 bits; };
struct f16_t { u16 bits; };

template <typename T> struct Elem;
template <> struct Elem<float> {
  typedef float Acc;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float a) { return a; }
};
template <> struct Elem<double> {
  typedef double Acc;
  static __device__ __forceinline__ double load(double v) { return v; }
  static __device__ __forceinline__ double store(double a) { return a; }
};
template <> struct Elem<bf16_t> {
  typedef float Acc;
  static __device__ __forceinline__ float load(bf16_t v) {
    return __uint_as_float(((unsigned)v.bits) << 16);
  }
  // Round to nearest even, NaN stays NaN (quieted), as the `half` crate on the CPU does.
  static __device__ __forceinline__ bf16_t store(float a) {
    unsigned u = __float_as_uint(a);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      r.bits = (u16)((u >> 16) | 0x40u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      r.bits = (u16)(u >> 16);
    }
    return r;
  }
};
template <> struct Elem<f16_t> {
  typedef float Acc;
  static __device__ __forceinline__ float load(f16_t v) {
#if defined(__CUDACC_RTC__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
#else
    return emu_half_to_float(v.bits);  // host emulator (tests only): not the PTX instruction
#endif
  }
  static __device__ __forceinline__ f16_t store(float a) {
    f16_t r;
#if defined(__CUDACC_RTC__)
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(a));
#else
    r.bits = emu_float_to_half_rn(a);  // host emulator (tests only): not the PTX instruction
#endif
    return r;
  }
};

// Two float32 values rounded to nearest even to bfloat16, as one 32-bit word (`lo` in its low
// half, the order of a pack in memory). On sm_80 and later one instruction for the pair, where
// Elem<bf16_t>::store takes about eight per element (the H200 run: the bfloat16 kernels issued
// too many instructions per byte to keep up with memory). cvt.rn.bf16x2.f32 puts its first
// source in the upper half (cuda_bf16.hpp's __floats2bfloat162_rn passes (b, a) for a low
// half a). It turns a NaN into the canonical 0x7fff, so NaN packs never come here (Narrow).
// The host emulator builds the same word from Elem<bf16_t>::store: the same bits for every
// non-NaN value.
__device__ __forceinline__ unsigned bf16x2_rn(float lo, float hi) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 800
  unsigned w;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
  return w;
#else
  return (unsigned)Elem<bf16_t>::store(lo).bits | ((unsigned)Elem<bf16_t>::store(hi).bits << 16);
#endif
}

// VEC values in A rounded to T: Elem<T>::store of each. bfloat16 packs round two at a time
// (bf16x2_rn), unless one of the values is NaN: that pack takes Elem<bf16_t>::store, which keeps
// a NaN's payload as the CPU bundle does (a branch the warp takes together unless a NaN is
// there: one compare per element on the common path).
template <typename T, int VEC> struct Narrow {
  static __device__ __forceinline__ void pack(T (&out)[VEC], const typename Elem<T>::Acc (&a)[VEC]) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = Elem<T>::store(a[e]);
  }
};
template <int VEC> struct Narrow<bf16_t, VEC> {
  static __device__ __forceinline__ void pack(bf16_t (&out)[VEC], const float (&a)[VEC]) {
    bool nan = false;
#pragma unroll
    for (int e = 0; e < VEC; ++e) nan |= !(a[e] == a[e]);
    if (VEC % 2 != 0 || nan) {  // an odd pack (the scalar kernels' VEC 1) has no pairs
#pragma unroll
      for (int e = 0; e < VEC; ++e) out[e] = Elem<bf16_t>::store(a[e]);
      return;
    }
#pragma unroll
    for (int e = 0; e + 1 < VEC; e += 2) {
      const unsigned w = bf16x2_rn(a[e], a[e + 1]);
#if defined(__CUDACC_RTC__)
      // The word as it is, as load_pack writes its words into a pack (out[e] is 4-byte
      // aligned: a pack of an even VEC is, and e is even). Written as two 16-bit halves, the
      // compiler split the word and joined it again: a shift and a byte permute per pair.
      *reinterpret_cast<unsigned*>(&out[e]) = w;
#else
      out[e].bits = (u16)w;
      out[e + 1].bits = (u16)(w >> 16);
#endif
    }
  }
};

// VEC elements of T, loaded and stored with the widest accesses their size allows. Aligned to
// its size up to 16 bytes, which is all the callers guarantee (an f32 weight next to bf16 x is
// a 32-byte pack read as two 16-byte loads).
template <typename T, int VEC>
struct __align__(sizeof(T) * VEC < 16 ? sizeof(T) * VEC : 16) Pack { T e[VEC]; };

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* base, i64 index) {
  typedef Pack<T, VEC> P;
  P p;
  const P* src = reinterpret_cast<const P*>(base) + index;
  if constexpr (sizeof(P) % 16 == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(&p);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(P) / 16); ++i) {
      EMU_GLOBAL(s + i, false);
      d[i] = __ldg(s + i);
    }
  } else if constexpr (sizeof(P) == 8) {
    EMU_GLOBAL(reinterpret_cast<const uint2*>(src), false);
    *reinterpret_cast<uint2*>(&p) = __ldg(reinterpret_cast<const uint2*>(src));
  } else {
    EMU_GLOBAL(src, false);
    p = *src;
  }
  return p;
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* base, i64 index, const Pack<T, VEC>& p) {
  typedef Pack<T, VEC> P;
  P* dst = reinterpret_cast<P*>(base) + index;
  if constexpr (sizeof(P) % 16 == 0) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(&p);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(P) / 16); ++i) {
      EMU_GLOBAL(d + i, true);
      d[i] = s[i];
    }
  } else if constexpr (sizeof(P) == 8) {
    EMU_GLOBAL(reinterpret_cast<uint2*>(dst), true);
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(&p);
  } else {
    EMU_GLOBAL(dst, true);
    *dst = p;
  }
}

// Element `e` of a pack, widened to A (Elem<T>::load). A bfloat16 pair is one 32-bit word of
// the pack: its low element is the word shifted up 16 bits and its high one the word with the
// low half cleared, one instruction each, where widening each 16-bit element alone took two
// for the high one (extract, shift). `e` is a constant once the callers' loops are unrolled.
template <typename T, int VEC>
__device__ __forceinline__ typename Elem<T>::Acc elem(const Pack<T, VEC>& p, int e) {
  return Elem<T>::load(p.e[e]);
}
template <int VEC>
__device__ __forceinline__ float elem(const Pack<bf16_t, VEC>& p, int e) {
  if constexpr (VEC % 2 == 0) {
    const unsigned word = (unsigned)p.e[e & ~1].bits | ((unsigned)p.e[e | 1].bits << 16);
    if (!(e & 1)) return __uint_as_float(word << 16);
#if defined(__CUDACC_RTC__)
    // In C++ the compiler turns the mask back into the 16-bit element shifted up (two
    // instructions: extract, shift); the PTX `and` keeps it one.
    unsigned high;
    asm("and.b32 %0, %1, 0xffff0000;" : "=r"(high) : "r"(word));
    return __uint_as_float(high);
#else
    return __uint_as_float(word & 0xffff0000u);
#endif
  } else {
    return Elem<bf16_t>::load(p.e[e]);
  }
}

// Elements a thread sums in A before adding the partial into the float64 level, and rows a
// thread's weight-gradient columns take in A before they are folded into the block's row.
#define FOLD_ELEMS 32
#define FOLD_ROWS 8

__device__ __forceinline__ double shfl_xor(double v, int offset) {
  return __shfl_xor_sync(0xffffffffu, v, offset);
}

// The float64 level of a sum of A partials (see "Sums" above). Adding two Wide values is
// commutative bit for bit, so the lanes of a shuffle tree all end with the same sum.
template <typename A> struct Wide;
template <> struct Wide<float> {
  double v;
  static __device__ __forceinline__ Wide zero() {
    Wide w;
    w.v = 0.0;
    return w;
  }
  __device__ __forceinline__ void add(float a) { v += (double)a; }
  __device__ __forceinline__ void merge(const Wide& o) { v += o.v; }
  __device__ __forceinline__ Wide shuffled(int offset) const {
    Wide w;
    w.v = shfl_xor(v, offset);
    return w;
  }
  __device__ __forceinline__ double value() const { return v; }
};
// hi + lo with lo collecting the exact rounding error of every addition into hi (Knuth's
// TwoSum, which FMA contraction cannot touch: it has no products).
template <> struct Wide<double> {
  double hi, lo;
  static __device__ __forceinline__ Wide zero() {
    Wide w;
    w.hi = 0.0;
    w.lo = 0.0;
    return w;
  }
  __device__ __forceinline__ void add(double a) {
    const double s = hi + a;
    const double bb = s - hi;
    lo += (hi - (s - bb)) + (a - bb);
    hi = s;
  }
  __device__ __forceinline__ void merge(const Wide& o) {
    const double s = hi + o.hi;
    const double bb = s - hi;
    lo = (lo + o.lo) + ((hi - (s - bb)) + (o.hi - bb));
    hi = s;
  }
  __device__ __forceinline__ Wide shuffled(int offset) const {
    Wide w;
    w.hi = shfl_xor(hi, offset);
    w.lo = shfl_xor(lo, offset);
    return w;
  }
  // An infinite sum has a NaN error term (inf - inf): the sum alone is the answer.
  __device__ __forceinline__ double value() const {
    return fabs(hi) <= 1.7976931348623157e308 ? hi + lo : hi;
  }
};

// Sum over the aligned groups of min(team, 32) lanes of a warp (every lane shuffles: a full
// mask; team is uniform, so every lane takes the same exchanges).
template <typename S>
__device__ __forceinline__ S warp_sum(S v, int team) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    if (offset < team) v.merge(v.shuffled(offset));
  return v;
}

// Sum over the `team` threads of a team (team uniform across the block). Every thread of the
// block must call it the same number of times. `red` holds one slot per warp of the block.
template <typename S>
__device__ __forceinline__ S team_sum(S v, int team, S* red) {
  v = warp_sum(v, team);
  if (team > 32) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) red[warp] = v;
    __syncthreads();
    const int first = (threadIdx.x / team) * (team >> 5);
    S total = S::zero();
    for (int i = 0; i < (team >> 5); ++i) total.merge(red[first + i]);
    __syncthreads();
    v = total;
  }
  return v;
}

// K sums of a row at the float64 level, reduced by one tree (team_sum, warp_sum): LayerNorm's
// centred sums (two) and the backward's three, where the RMS norm has one.
template <typename S, int K> struct Sums {
  S s[K];
  static __device__ __forceinline__ Sums zero() {
    Sums r;
#pragma unroll
    for (int k = 0; k < K; ++k) r.s[k] = S::zero();
    return r;
  }
  __device__ __forceinline__ void merge(const Sums& o) {
#pragma unroll
    for (int k = 0; k < K; ++k) s[k].merge(o.s[k]);
  }
  __device__ __forceinline__ Sums shuffled(int offset) const {
    Sums r;
#pragma unroll
    for (int k = 0; k < K; ++k) r.s[k] = s[k].shuffled(offset);
    return r;
  }
};

// LayerNorm's statistics of a row from its centred sums (see rmsnorm_fwd_impl): the shift
// d = sum(x - m) / n and rstd = 1 / sqrt(sum((x - m)^2) / n - d^2 + eps), in float64 (d
// unrounded in the variance), each rounded once to A; a negative variance (rounding, a row of
// equal elements) is 0, a NaN one stays NaN. The CPU bundle's layer::shift_and_rstd, with
// multiplies by `inv_n` = 1 / n for its divisions (a float64 division is a subroutine whose
// registers the cached row holds: the forward spilled with them).
template <typename A>
__device__ __forceinline__ void shift_and_rstd(double s1, double s2, double inv_n, float eps,
                                               A& d, A& r) {
  const double dd = s1 * inv_n;
  double var = s2 * inv_n - dd * dd;
  if (var < 0.0) var = 0.0;
  d = A(dd);
  r = A(1.0 / sqrt(var + (double)eps));
}

// 1 / sqrt(sum_sq / n + eps), in float64, rounded once to A.
template <typename A>
__device__ __forceinline__ A rstd_of(double sum_sq, int n, float eps) {
  return A(1.0 / sqrt(sum_sq / (double)n + (double)eps));
}

// The weight a kernel applies, `offset + w` in A: w widened (or, a float64 weight with a float32
// accumulator, rounded) to A, plus the scale offset (zero-centred gamma: Gemma's `1 + w`), one
// rounding in A, inside the kernel: never `1 + w` rounded to a bfloat16 weight, and no pass of
// its own. The launch code passes -0.0 for no offset: w + -0.0 is w bit for bit, signed zeros
// included, so one expression serves both (the CPU bundle's math::offset_weights adds the same
// two values in A).
template <typename A, typename W, int VEC>
__device__ __forceinline__ A weight_of(const Pack<W, VEC>& w, int e, A offset) {
  return A(elem(w, e)) + offset;
}

// x * r * (offset + w) (w may be null: then x * r) for one pack; its weight pack read here, or
// given (`loaded`: FWD_WEIGHT_EARLY's, read before the reduction). OFFSET false: the call has
// no scale offset (the launch passes -0.0), whose addition is the identity bit for bit
// (weight_of), so it is left out: one add per element fewer (rmsnorm_fwd_impl's callers pick).
// LAYER (LayerNorm): ((x - m) - d) * r * (offset + w) + b, `br` the bias row (may be null), `m`
// the row's rounded mean and `d` its shift; unused by the RMS norm.
template <typename T, typename W, int VEC, bool OFFSET, bool LAYER>
__device__ __forceinline__ Pack<T, VEC> scale(const Pack<T, VEC>& p, const W* wr, const W* br,
                                              int v, typename Elem<T>::Acc r,
                                              typename Elem<T>::Acc m, typename Elem<T>::Acc d,
                                              typename Elem<T>::Acc offset,
                                              const Pack<W, VEC>* loaded = nullptr) {
  typedef typename Elem<T>::Acc A;
  A c[VEC], vals[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) c[e] = LAYER ? (elem(p, e) - m) - d : elem(p, e);
  if (wr) {
    const Pack<W, VEC> wp = loaded ? *loaded : load_pack<W, VEC>(wr, v);
#pragma unroll
    for (int e = 0; e < VEC; ++e)
      vals[e] = c[e] * r * (OFFSET ? weight_of<A>(wp, e, offset) : A(elem(wp, e)));
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) vals[e] = c[e] * r;
  }
  if constexpr (LAYER) {
    if (br) {
      const Pack<W, VEC> bp = load_pack<W, VEC>(br, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) vals[e] += A(elem(bp, e));
    }
  }
  Pack<T, VEC> out;
  Narrow<T, VEC>::pack(out.e, vals);
  return out;
}

// Pack `v` of the forward's input row, adding its squares (LAYER: its elements) to `part`: x,
// or with a residual h = x + residual rounded to T (written to h when `store_h`).
template <typename T, int VEC, bool RESIDUAL, bool LAYER>
__device__ __forceinline__ Pack<T, VEC> load_input(const T* xr, const T* rr, T* hr, int v,
                                                   bool store_h, typename Elem<T>::Acc& part) {
  typedef typename Elem<T>::Acc A;
  Pack<T, VEC> p = load_pack<T, VEC>(xr, v);
  if constexpr (RESIDUAL) {
    const Pack<T, VEC> q = load_pack<T, VEC>(rr, v);
    A sum[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[e] = elem(p, e) + elem(q, e);
    Narrow<T, VEC>::pack(p.e, sum);  // h in x's dtype: the norm is of what is returned
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const A hv = elem(p, e);
      part += LAYER ? hv : hv * hv;
    }
    if (store_h) store_pack<T, VEC>(hr, v, p);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const A a = elem(p, e);
      part += LAYER ? a : a * a;
    }
  }
  return p;
}

// ------------------------------------------------------------------------------------------
// Forward: y = x * rstd * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps); with RESIDUAL the
// same of h = x + residual, and h written.
// LAYER (LayerNorm, the layernorm_* kernels): y = ((x - m) - d) * rstd * (offset + w) + b, its
// statistics from the cached row, as the CPU bundle's math/layer.rs takes them: the row's sum
// gives the mean m (rounded once to A: the `mean` result), then the deviations x - m give both
// d = mean(x - m) (the part of the true mean m could not hold) and rstd = 1 / sqrt(mean((x -
// m)^2) - d^2 + eps) (shift_and_rstd): never E[x^2] - E[x]^2. Two tree reductions per row
// where the RMS norm has one, no more global traffic on the cached path (the streaming path
// reads its row a third time).
// ------------------------------------------------------------------------------------------
template <typename T, typename W, int VEC, int VPT, bool RESIDUAL, bool OFFSET, bool LAYER>
__device__ __forceinline__ void rmsnorm_fwd_impl(const T* __restrict__ x,
                                                 const T* __restrict__ residual,
                                                 const W* __restrict__ w,
                                                 const W* __restrict__ b, T* __restrict__ y,
                                                 T* __restrict__ h,
                                                 typename Elem<T>::Acc* __restrict__ mean,
                                                 typename Elem<T>::Acc* __restrict__ rstd, i64 rows,
                                                 int n, int team, float eps, float offset,
                                                 i64 rows_per_group) {
  typedef typename Elem<T>::Acc A;
  const A off = A(offset);
  typedef Wide<A> S;
  // One slot per warp for the team sums: of one sum (Sums<S, 1> is S's bits), and LayerNorm's
  // centred pair.
  __shared__ Sums<S, LAYER ? 2 : 1> red_sums[32];
  Sums<S, 1>* red = reinterpret_cast<Sums<S, 1>*>(red_sums);
  const int teams = blockDim.x / team;
  const int lane = threadIdx.x % team;
  const int nv = n / VEC;
  const bool cached = nv <= team * VPT;
  const int fold_packs = FOLD_ELEMS / VEC;
  for (i64 base = (i64)blockIdx.x * teams; base < rows; base += (i64)gridDim.x * teams) {
    const i64 row = base + threadIdx.x / team;
    const bool valid = row < rows;
    const T* xr = x + row * n;
    const T* rr = RESIDUAL ? residual + row * n : nullptr;
    T* hr = RESIDUAL ? h + row * n : nullptr;
    T* yr = y + row * n;
    // One weight row for every row (no batched weight): no 64-bit division per row (a call to
    // a divide routine of about 80 instructions in the SASS); a uniform branch.
    const i64 group = rows_per_group >= rows ? 0 : row / rows_per_group;
    const W* wr = w ? w + group * n : nullptr;
    const W* br = LAYER && b ? b + group * n : nullptr;
    Sums<S, 1> ss = Sums<S, 1>::zero();
    A part = A(0);
    Pack<T, VEC> cache[VPT];
    // FWD_WEIGHT_EARLY (a kernel variant): the cached path reads the row's weight packs with
    // its input, their loads in flight during the reduction rather than issued after it.
    Pack<W, VEC> wcache[FWD_WEIGHT_EARLY ? VPT : 1];
    if (cached) {
      // One partial per FOLD_ELEMS elements: the default VPT * VEC <= FOLD_ELEMS is one per
      // row; a variant caching more (FWD_VPT 8 of 8-element vectors) folds in between.
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = lane + k * team;
        if (valid && v < nv) {
          cache[k] = load_input<T, VEC, RESIDUAL, LAYER>(xr, rr, hr, v, true, part);
          if (FWD_WEIGHT_EARLY && wr) wcache[k] = load_pack<W, VEC>(wr, v);
        }
        if constexpr (VPT * VEC > FOLD_ELEMS) {
          if ((k + 1) % fold_packs == 0 && k + 1 < VPT) {
            ss.s[0].add(part);
            part = A(0);
          }
        }
      }
    } else if (valid) {
      int packs = 0;
      for (int v = lane; v < nv; v += team) {
        EMU_STEP();
        load_input<T, VEC, RESIDUAL, LAYER>(xr, rr, hr, v, true, part);
        if (++packs == fold_packs) {
          ss.s[0].add(part);
          part = A(0);
          packs = 0;
        }
      }
    }
    ss.s[0].add(part);
    ss = team_sum(ss, team, red);
    A r, m = A(0), d = A(0);
    if constexpr (LAYER) {
      // The centred sums, of the cache (or the row again), in A per FOLD_ELEMS elements as the
      // first sum.
      const double inv_n = 1.0 / (double)n;
      m = A(ss.s[0].value() * inv_n);
      Sums<S, 2> cs = Sums<S, 2>::zero();
      A c1 = A(0), c2 = A(0);
      const auto centred = [&](const Pack<T, VEC>& p) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const A c = elem(p, e) - m;
          c1 += c;
          c2 += c * c;
        }
      };
      const auto fold = [&]() {
        cs.s[0].add(c1);
        cs.s[1].add(c2);
        c1 = A(0);
        c2 = A(0);
      };
      if (cached) {
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          if (valid && lane + k * team < nv) centred(cache[k]);
          if constexpr (VPT * VEC > FOLD_ELEMS) {
            if ((k + 1) % fold_packs == 0 && k + 1 < VPT) fold();
          }
        }
      } else if (valid) {
        int packs = 0;
        A unused = A(0);
        for (int v = lane; v < nv; v += team) {
          EMU_STEP();
          centred(load_input<T, VEC, RESIDUAL, LAYER>(xr, rr, hr, v, false, unused));
          if (++packs == fold_packs) {
            fold();
            packs = 0;
          }
        }
      }
      fold();
      cs = team_sum(cs, team, red_sums);
      shift_and_rstd<A>(cs.s[0].value(), cs.s[1].value(), inv_n, eps, d, r);
    } else {
      r = rstd_of<A>(ss.s[0].value(), n, eps);
    }
    if (!valid) continue;
    if (lane == 0) {
      EMU_GLOBAL(rstd + row, true);
      rstd[row] = r;
      if constexpr (LAYER) {
        EMU_GLOBAL(mean + row, true);
        mean[row] = m;
      }
    }
    if (cached) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = lane + k * team;
        if (v < nv) {
          const Pack<W, VEC>* loaded = FWD_WEIGHT_EARLY ? &wcache[k] : nullptr;
          store_pack<T, VEC>(
              yr, v, scale<T, W, VEC, OFFSET, LAYER>(cache[k], wr, br, v, r, m, d, off, loaded));
        }
      }
    } else {
      // Long rows: the input again (h recomputed from x and the residual rather than read
      // back: h may not be read through the read-only cache that load_pack uses).
      A unused = A(0);
      for (int v = lane; v < nv; v += team) {
        EMU_STEP();
        const Pack<T, VEC> p = load_input<T, VEC, RESIDUAL, LAYER>(xr, rr, hr, v, false, unused);
        store_pack<T, VEC>(yr, v, scale<T, W, VEC, OFFSET, LAYER>(p, wr, br, v, r, m, d, off));
      }
    }
  }
}

// The forward's entry: one of two copies of rmsnorm_fwd_impl, with the scale offset's add, or
// without it for calls that have none (the launch passes -0.0; see scale).
template <typename T, typename W, int VEC, int VPT, bool RESIDUAL, bool LAYER>
__device__ __forceinline__ void rmsnorm_fwd(const T* x, const T* residual, const W* w,
                                            const W* b, T* y, T* h,
                                            typename Elem<T>::Acc* mean,
                                            typename Elem<T>::Acc* rstd, i64 rows, int n,
                                            int team, float eps, float offset,
                                            i64 rows_per_group) {
  if (__float_as_uint(offset) != 0x80000000u)
    rmsnorm_fwd_impl<T, W, VEC, VPT, RESIDUAL, true, LAYER>(
        x, residual, w, b, y, h, mean, rstd, rows, n, team, eps, offset, rows_per_group);
  else
    rmsnorm_fwd_impl<T, W, VEC, VPT, RESIDUAL, false, LAYER>(
        x, residual, w, b, y, h, mean, rstd, rows, n, team, eps, offset, rows_per_group);
}

// `p`, with its value hidden from the optimizer: address arithmetic on it then stays where it
// is written instead of being hoisted out of the enclosing loop. An empty inline-PTX move on the
// device; nothing in the host emulator.
template <typename P>
__device__ __forceinline__ P* opaque(P* p) {
#if defined(__CUDACC_RTC__)
  asm volatile("mov.b64 %0, %0;" : "+l"(p));
#endif
  return p;
}

// The backward block's weight-gradient row at the float64 level: in shared memory (n Wide
// values, which plan.rs gives such launches, from Wide value `at`: LayerNorm's bias gradient
// row follows the weight's) when several teams add into it, else the block's partial row
// itself, each of whose columns one thread owns.
template <typename S>
__device__ __forceinline__ S* weight_row(unsigned char* smem_raw, S* prow, int teams, int at = 0) {
  return teams > 1 ? reinterpret_cast<S*>(smem_raw) + at : prow;
}

// Adds the threads' weight-gradient sums of the last rows (acc, in A) into the block's row
// `wrow` at the float64 level (`fresh`: the row holds nothing yet) and clears them. Several
// teams add in team order, between barriers (a fixed order: reproducible bits); one team owns
// its columns. The row's addresses are computed here, per fold (see `opaque`): hoisted out of
// the row loop they held about 16 registers through it, and the float32 kernel spilled its
// cached rows.
template <typename A, int VEC, int VPT>
__device__ __forceinline__ void fold_rows(Wide<A>* wrow, A (&acc)[VPT][VEC], int teams,
                                          int team_id, int team, int lane, int nv, bool fresh) {
  wrow = opaque(wrow);
  for (int t = 0; t < teams; ++t) {
    if (team_id == t) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = lane + k * team;
        if (v < nv)
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            if (!(fresh && t == 0)) EMU_GLOBAL(wrow + v * VEC + e, false);
            Wide<A> s = (fresh && t == 0) ? Wide<A>::zero() : wrow[v * VEC + e];
            s.add(acc[k][e]);
            EMU_GLOBAL(wrow + v * VEC + e, true);
            wrow[v * VEC + e] = s;
            acc[k][e] = A(0);
          }
      }
    }
    if (teams > 1) __syncthreads();
  }
}

// The block's narrow partial row: n float32 where the Wide row would be (rmsnorm_bwd_impl), of
// its cluster `unit` (the block without clusters), from the block's first column `col0`.
template <typename A, typename S>
__device__ __forceinline__ A* narrow_row(S* partial, i64 unit, int n, int col0) {
  return reinterpret_cast<A*>(opaque(partial)) + unit * n + col0;
}

// Writes a one-team block's weight-gradient sums (acc, in A: at most FOLD_ROWS rows, never
// folded) as its narrow partial row. A thread's pack k holds the columns of vector
// lane + k * team, so a warp's 32 vectors are contiguous: 16-byte packs (float32, VEC 4) are
// stored as they are; packs of 8 float32 (VEC 8: bfloat16, float16 input) are first transposed
// among each 8 lanes (three xor-shuffle stages), after which store j of lane i in lane group g
// writes element i of the group's vector j: each group's 8 lanes write one whole 32-byte sector.
// Every lane of the warp takes every shuffle (k and the stages are uniform).
template <typename A, int VEC, int VPT>
__device__ __forceinline__ void store_narrow(A* nrow, A (&acc)[VPT][VEC], int team, int lane,
                                             int nv) {
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int v = lane + k * team;
    if constexpr (VEC == 8) {
      const int i = lane & 7;
      A(&a)[8] = acc[k];  // transposed in place (acc is not used after this)
#pragma unroll
      for (int s = 4; s >= 1; s >>= 1)
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if ((e & s) == 0) {
            const bool upper = (i & s) != 0;
            const A got = __shfl_xor_sync(0xffffffffu, upper ? a[e] : a[e | s], s);
            if (upper)
              a[e] = got;
            else
              a[e | s] = got;
          }
      // Lane i now holds element i of the vectors v - i + j, j = 0..7.
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int u = v - i + j;
        if (u < nv) {
          EMU_GLOBAL(nrow + u * 8 + i, true);
          nrow[u * 8 + i] = a[j];
        }
      }
    } else if (v < nv) {
      Pack<A, VEC> p;
#pragma unroll
      for (int e = 0; e < VEC; ++e) p.e[e] = acc[k][e];
      store_pack<A, VEC>(nrow, v, p);
    }
  }
}

// Stores pack `v` of a dx row from its values `d` in A. With a `dh` row (the fused residual add's
// backward: the gradient that reached h = x + residual from later layers), d + dh in A, rounded
// once to T, where adding dh to d rounded to T would round twice (off by up to half a unit of d,
// which is many units of a sum that cancels: tests/gpu_emulated.rs measures 184-349 units
// against one). dh is read as x and dy are, one 16-byte vector per pack on the vector path;
// `dhr` is null or not for the whole launch, so the branch never diverges.
template <typename T, int VEC>
__device__ __forceinline__ void store_dx(T* dxr, const T* dhr, int v,
                                         const typename Elem<T>::Acc (&d)[VEC]) {
  Pack<T, VEC> out;
  if (dhr) {
    const Pack<T, VEC> hp = load_pack<T, VEC>(dhr, v);
    typename Elem<T>::Acc sum[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) sum[e] = d[e] + elem(hp, e);
    Narrow<T, VEC>::pack(out.e, sum);
  } else {
    Narrow<T, VEC>::pack(out.e, d);
  }
  store_pack<T, VEC>(dxr, v, out);
}

// Thread block clusters (sm_90; plan.rs's `cluster`): the blocks of a cluster share each row
// of their chunk, block `rank` of `blocks` owning one slice of its columns. Without a cluster
// launch a block is a cluster of one. Compiled for an architecture without clusters (below
// sm_90) the `_c` kernels trap rather than run as clusters of one: a module of compute_80 code
// on a 9.0 device (an NVRTC that lacks sm_90) would otherwise take a cluster plan's launch and
// write its partial rows out of place. The emulator runs a cluster's blocks together and
// switches between them at cluster_sync.
struct ClusterPlace {
  int rank, blocks;
};
__device__ __forceinline__ ClusterPlace cluster_place() {
  ClusterPlace c;
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  unsigned rank, blocks;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n\tmov.u32 %1, %%cluster_nctarank;"
               : "=r"(rank), "=r"(blocks));
  c.rank = (int)rank;
  c.blocks = (int)blocks;
#elif defined(__CUDACC_RTC__)
  __trap();
  c.rank = 0;
  c.blocks = 1;
#else
  c.rank = emu_cluster_rank();  // host emulator (tests only)
  c.blocks = emu_cluster_blocks();
#endif
  return c;
}
// Every thread of every block of the cluster waits for all the others; the global memory each
// wrote before it is visible to all after it: arrive has release semantics and wait acquire
// by default (PTX ISA 7.8; spelling `.release` / `.acquire` out would need PTX ISA 8.0, CUDA
// 12.0, where the same barrier takes CUDA 11.8's NVRTC).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#elif defined(__CUDACC_RTC__)
  __syncthreads();
#else
  emu_cluster_sync();
#endif
}
// A 64-bit word another block of the cluster wrote before the last cluster_sync: a relaxed
// load at cluster scope, which L1 (not coherent between multiprocessors) cannot answer from a
// line it holds from an earlier row.
__device__ __forceinline__ unsigned long long load_cluster_word(const unsigned long long* p) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 900
  unsigned long long v;
  asm volatile("ld.relaxed.cluster.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return *(const volatile unsigned long long*)p;
#endif
}

// The dot product of a row split across a cluster: each block's sum over its columns (`dot`,
// already the same in all its threads) is written to its slot of `slots` (one per block of
// the cluster), and after a cluster barrier every thread adds all the slots in rank order,
// so every block of the cluster has the same bits. Two sets of slots alternate between rows
// (the caller's parity): a block writes a row's slot only after the barrier of the row before,
// which every block passes only once it has read the slots of the row before that.
template <typename S>
__device__ __forceinline__ S cluster_dot(S dot, S* slots, int rank, int size) {
  if (threadIdx.x == 0) {
    EMU_GLOBAL(slots + rank, true);
    slots[rank] = dot;
  }
  cluster_sync();
  S total = S::zero();
  for (int q = 0; q < size; ++q) {
    EMU_GLOBAL(slots + q, false);
    unsigned long long words[sizeof(S) / 8];
    const unsigned long long* from = reinterpret_cast<const unsigned long long*>(slots + q);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(S) / 8); ++i) words[i] = load_cluster_word(from + i);
    S s;
    memcpy(&s, words, sizeof(S));
    total.merge(s);
  }
  return total;
}

// ------------------------------------------------------------------------------------------
// Backward: g = dy * (offset + w); dx = rstd * g - x * rstd^3 / n * sum(g * x) (+ dh);
// dw += dy * x * rstd (the gradient with respect to w: the offset does not enter it).
// Block b serves group g = b / blocks_per_group: rows [g * rows_per_group + (b % blocks_per_group)
// * chunk, ...) up to chunk rows within the group, with the weight row w + g * n, and writes
// partial[b * n ...] (when w). A non-null `dh` (x's shape) is added to dx in A before its one
// rounding (see store_dx).
// LAYER (LayerNorm, the layernorm_bwd kernels), given the forward's mean m and rstd: the first
// pass sums x - m, g and g * (x - m) (one tree for the three), whence the shift d = mean(x - m)
// (the forward's bits: what a float32 m could not hold), c1 = mean(g) and c2 = mean(g * xhat) =
// rstd * (sum(g (x - m)) - d sum(g)) / n; then xhat = ((x - m) - d) * rstd, dx = rstd * (g - c1
// - xhat * c2), dw += dy * xhat and, with `partial_b`, the bias's gradient db += dy into partial
// rows of its own (beside the weight's in shared memory). The CPU bundle's math/layer.rs.
// CLUSTER (the `_c` kernels, launched in clusters of C blocks on sm_90; the RMS norm's only):
// "block b" above is cluster b; its C blocks share every row of the chunk, block q taking
// columns [q n / C, (q + 1) n / C) (its slice: cached, where a whole row would stream), and the
// row's dot product is the sum of the C slices' (cluster_dot, through `dots`: 2 C Wide slots per
// cluster). The cluster writes one partial row, each block its slice of it: C times fewer
// partial rows than blocks, while every multiprocessor has a block (docs/gpu-traffic.md).
// ------------------------------------------------------------------------------------------

// Adds a streaming row's term for column `c` into the block's partial row: the Wide row `prow`
// if there is one, else the narrow float32 row of `narrow_partial` (see rmsnorm_bwd_impl), else
// nowhere (no such gradient).
template <typename A>
__device__ __forceinline__ void add_partial(Wide<A>* prow, Wide<A>* narrow_partial, i64 unit,
                                            int n, int col0, int c, A term) {
  if (prow) {
    EMU_GLOBAL(prow + c, false);
    EMU_GLOBAL(prow + c, true);
    prow[c].add(term);
  } else if (narrow_partial) {
    A* nrow = narrow_row<A>(narrow_partial, unit, n, col0);
    EMU_GLOBAL(nrow + c, false);
    EMU_GLOBAL(nrow + c, true);
    nrow[c] += term;
  }
}

// Adds the backward's first-pass partials (in A) into its row sums and clears them.
template <typename S, typename A, int K>
__device__ __forceinline__ void fold_parts(Sums<S, K>& dot, A (&part)[K]) {
#pragma unroll
  for (int q = 0; q < K; ++q) {
    dot.s[q].add(part[q]);
    part[q] = A(0);
  }
}

// The first pass's terms of one element, x in A and g = dy * (offset + w) (or dy): the RMS
// norm's g * x (K 1); LayerNorm's x - m, g and g * (x - m) (K 3).
template <typename A, int K>
__device__ __forceinline__ void add_terms(A (&part)[K], A xa, A g, A m) {
  if constexpr (K == 1) {
    part[0] += g * xa;
  } else {
    const A c = xa - m;
    part[0] += c;
    part[1] += g;
    part[2] += g * c;
  }
}

template <typename T, typename W, int VEC, int VPT, bool CLUSTER, bool LAYER>
__device__ __forceinline__ void rmsnorm_bwd_impl(const T* __restrict__ x, const W* __restrict__ w,
                                                 const typename Elem<T>::Acc* __restrict__ mean,
                                                 const typename Elem<T>::Acc* __restrict__ rstd,
                                                 const T* __restrict__ dy,
                                                 const T* __restrict__ dh, T* __restrict__ dx,
                                                 Wide<typename Elem<T>::Acc>* __restrict__ partial,
                                                 Wide<typename Elem<T>::Acc>* __restrict__ partial_b,
                                                 Wide<typename Elem<T>::Acc>* dots, int n,
                                                 int team, float offset, i64 chunk,
                                                 i64 rows_per_group, i64 blocks_per_group) {
  typedef typename Elem<T>::Acc A;
  typedef Wide<A> S;
  constexpr int K = LAYER ? 3 : 1;
  const A off = A(offset);
  __shared__ Sums<S, K> red[32];
#if defined(__CUDACC_RTC__)
  extern __shared__ unsigned char smem_raw[];
#else
  unsigned char* smem_raw = emu_dynamic_shared();  // host emulator (tests only)
#endif
  const int teams = blockDim.x / team;
  const int team_id = threadIdx.x / team;
  const int lane = threadIdx.x % team;
  // The cluster (CLUSTER) or the block that owns the chunk, and the block's columns: the
  // packs [col0 / VEC, col0 / VEC + nv) of each row (all of them without clusters).
  const ClusterPlace place = CLUSTER ? cluster_place() : ClusterPlace{0, 1};
  const int csize = place.blocks;
  const int crank = place.rank;
  const i64 unit = CLUSTER ? (i64)blockIdx.x / csize : (i64)blockIdx.x;
  const int nv = n / VEC / csize;
  const int col0 = crank * nv * VEC;
  const bool cached = nv <= team * VPT;
  const int fold_packs = FOLD_ELEMS / VEC;
  // A float64 multiply in the row loop, not a division: the division's subroutine needs
  // registers that the cached rows hold (it made the float32 kernel spill).
  const double inv_n = 1.0 / (double)n;
  const i64 group = unit / blocks_per_group;
  const i64 group_first = group * rows_per_group;
  const i64 first = group_first + (unit % blocks_per_group) * chunk;
  const i64 last = min(group_first + rows_per_group, first + chunk);
  const W* wg = w ? w + group * n + col0 : nullptr;
  // The gradient rows this launch writes: the weight's (`partial`, with a weight) and
  // LayerNorm's bias's (`partial_b`); uniform across the launch.
  const bool dw_rows = partial != nullptr;
  const bool db_rows = LAYER && partial_b != nullptr;
  // Narrow partials: a block of one team (long rows) with at most FOLD_ROWS rows sums each
  // column in A only (its float32 acc, never folded into the float64 level), and a float32 holds
  // that sum exactly: its partial row is n float32, half the bytes, and the finalize's float64
  // sum is bit for bit what it was from a float64 row (0.0 + the float32 sum). plan.rs gives
  // few-rows-long-rows shapes such chunks (`narrow_partials`); the finalize takes `narrow`.
  // The narrow row's address is computed where it is used (`narrow_row`): one more pointer held
  // through the row loop made the kernels spill.
  const bool narrow = (dw_rows || db_rows) && sizeof(A) == 4 && teams == 1 && chunk <= FOLD_ROWS;
  S* prow = dw_rows && !narrow ? partial + unit * n + col0 : nullptr;
  S* prow_b = db_rows && !narrow ? partial_b + unit * n + col0 : nullptr;
  const bool wide_rows = prow || prow_b;
  // The bias's row in shared memory follows the weight's (plan.rs sizes both).
  const int b_at = dw_rows ? n : 0;
  A acc[VPT][VEC];
  A accb[LAYER ? VPT : 1][LAYER ? VEC : 1];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      acc[k][e] = A(0);
      if constexpr (LAYER) accb[k][e] = A(0);
    }
  if (prow && !cached) {
    // Streaming path (one team per block): each row's terms go straight into the partial row.
    for (int c = threadIdx.x; c < nv * VEC; c += blockDim.x) {
      EMU_GLOBAL(prow + c, true);
      prow[c] = S::zero();
    }
    __syncthreads();
  }
  if (narrow && dw_rows && !cached) {
    A* nrow = narrow_row<A>(partial, unit, n, col0);
    for (int c = threadIdx.x; c < nv * VEC; c += blockDim.x) {
      EMU_GLOBAL(nrow + c, true);
      nrow[c] = A(0);
    }
    __syncthreads();
  }
  if constexpr (LAYER) {
    // The same for the bias's gradient.
    if (prow_b && !cached) {
      for (int c = threadIdx.x; c < nv * VEC; c += blockDim.x) {
        EMU_GLOBAL(prow_b + c, true);
        prow_b[c] = S::zero();
      }
      __syncthreads();
    }
    if (narrow && db_rows && !cached) {
      A* nrow = narrow_row<A>(partial_b, unit, n, col0);
      for (int c = threadIdx.x; c < nv * VEC; c += blockDim.x) {
        EMU_GLOBAL(nrow + c, true);
        nrow[c] = A(0);
      }
      __syncthreads();
    }
  }
  int iterations = 0;  // of the row loop, the same in every thread: a fold every FOLD_ROWS
  for (i64 base = first; base < last; base += teams) {
    const i64 row = base + team_id;
    const bool valid = row < last;
    const T* xr = x + row * n + col0;
    const T* dyr = dy + row * n + col0;
    T* dxr = dx + row * n + col0;
    if (valid) EMU_GLOBAL(rstd + row, false);
    const A r = valid ? rstd[row] : A(0);
    A m = A(0);
    if constexpr (LAYER) {
      if (valid) {
        EMU_GLOBAL(mean + row, false);
        m = mean[row];
      }
    }
    Sums<S, K> dot = Sums<S, K>::zero();
    A part[K];
#pragma unroll
    for (int q = 0; q < K; ++q) part[q] = A(0);
    Pack<T, VEC> xc[VPT], gc[VPT];
    if (cached) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = lane + k * team;
        if (valid && v < nv) {
          xc[k] = load_pack<T, VEC>(xr, v);
          gc[k] = load_pack<T, VEC>(dyr, v);
        }
      }
      // At most VPT * VEC <= FOLD_ELEMS elements per thread: one partial.
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int v = lane + k * team;
        if (valid && v < nv) {
          if (wg) {
            const Pack<W, VEC> wp = load_pack<W, VEC>(wg, v);
#pragma unroll
            for (int e = 0; e < VEC; ++e)
              add_terms<A, K>(part, elem(xc[k], e), elem(gc[k], e) * weight_of<A>(wp, e, off), m);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) add_terms<A, K>(part, elem(xc[k], e), elem(gc[k], e), m);
          }
        }
      }
    } else if (valid) {
      int packs = 0;
      for (int v = lane; v < nv; v += team) {
        EMU_STEP();
        const Pack<T, VEC> xp = load_pack<T, VEC>(xr, v);
        const Pack<T, VEC> gp = load_pack<T, VEC>(dyr, v);
        if (wg) {
          const Pack<W, VEC> wp = load_pack<W, VEC>(wg, v);
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            add_terms<A, K>(part, elem(xp, e), elem(gp, e) * weight_of<A>(wp, e, off), m);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) add_terms<A, K>(part, elem(xp, e), elem(gp, e), m);
        }
        if (++packs == fold_packs) {
          fold_parts(dot, part);
          packs = 0;
        }
      }
    }
    fold_parts(dot, part);
    dot = team_sum(dot, team, red);
    if constexpr (CLUSTER)
      dot = cluster_dot(dot, reinterpret_cast<Sums<S, K>*>(dots) +
                                 (unit * 2 + ((base - first) & 1)) * csize,
                        crank, csize);
    if (valid) {
      // RMS: c = rstd^3 * sum(g * x) / n. LayerNorm: the shift d, c1 and c = c2 (see above).
      // In float64, each rounded once.
      A c, c1 = A(0), d = A(0);
      if constexpr (LAYER) {
        d = A(dot.s[0].value() * inv_n);
        const double sg = dot.s[1].value();
        c1 = A(sg * inv_n);
        c = A((dot.s[2].value() - (double)d * sg) * inv_n * (double)r);
      } else {
        const double rd = (double)r;
        c = A(rd * rd * rd * (dot.s[0].value() * inv_n));
      }
      // dh's row, computed here rather than with x's, dy's and dx's at the top of the row loop:
      // held through the loop it spilled more (float32 x with a float64 weight, sm_80: 56/148
      // bytes of spill stores/loads against 40/132).
      const T* dhr = dh ? dh + row * n + col0 : nullptr;
      if (cached) {
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          const int v = lane + k * team;
          if (v < nv) {
            A dv[VEC];
            if constexpr (LAYER) {
              const Pack<W, VEC> wp = wg ? load_pack<W, VEC>(wg, v) : Pack<W, VEC>{};
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                const A ga = elem(gc[k], e);
                const A xh = ((elem(xc[k], e) - m) - d) * r;
                const A g = wg ? ga * weight_of<A>(wp, e, off) : ga;
                dv[e] = r * (g - c1 - xh * c);
                acc[k][e] += ga * xh;
                accb[k][e] += ga;
              }
            } else if (wg) {
              const Pack<W, VEC> wp = load_pack<W, VEC>(wg, v);
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                const A xa = elem(xc[k], e);
                const A ga = elem(gc[k], e);
                dv[e] = r * ga * weight_of<A>(wp, e, off) - xa * c;
                acc[k][e] += ga * xa * r;
              }
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e)
                dv[e] = r * elem(gc[k], e) - elem(xc[k], e) * c;
            }
            store_dx<T, VEC>(dxr, dhr, v, dv);
          }
        }
      } else {
        for (int v = lane; v < nv; v += team) {
          EMU_STEP();
          const Pack<T, VEC> xp = load_pack<T, VEC>(xr, v);
          const Pack<T, VEC> gp = load_pack<T, VEC>(dyr, v);
          A dv[VEC];
          if constexpr (LAYER) {
            const Pack<W, VEC> wp = wg ? load_pack<W, VEC>(wg, v) : Pack<W, VEC>{};
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              const A ga = elem(gp, e);
              const A xh = ((elem(xp, e) - m) - d) * r;
              const A g = wg ? ga * weight_of<A>(wp, e, off) : ga;
              dv[e] = r * (g - c1 - xh * c);
              add_partial<A>(prow, narrow && dw_rows ? partial : nullptr, unit, n, col0,
                             v * VEC + e, ga * xh);
              add_partial<A>(prow_b, narrow && db_rows ? partial_b : nullptr, unit, n, col0,
                             v * VEC + e, ga);
            }
          } else if (wg) {
            const Pack<W, VEC> wp = load_pack<W, VEC>(wg, v);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              const A xa = elem(xp, e);
              const A ga = elem(gp, e);
              dv[e] = r * ga * weight_of<A>(wp, e, off) - xa * c;
              add_partial<A>(prow, narrow ? partial : nullptr, unit, n, col0, v * VEC + e,
                             ga * xa * r);
            }
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) dv[e] = r * elem(gp, e) - elem(xp, e) * c;
          }
          store_dx<T, VEC>(dxr, dhr, v, dv);
        }
      }
    }
    if (wide_rows && cached && ++iterations % FOLD_ROWS == 0) {
      if (prow)
        fold_rows<A, VEC, VPT>(weight_row(smem_raw, prow, teams), acc, teams, team_id, team, lane,
                               nv, iterations == FOLD_ROWS);
      if constexpr (LAYER)
        if (prow_b)
          fold_rows<A, VEC, VPT>(weight_row(smem_raw, prow_b, teams, b_at), accb, teams, team_id,
                                 team, lane, nv, iterations == FOLD_ROWS);
    }
  }
  if (narrow && cached) {
    if (dw_rows)
      store_narrow<A, VEC, VPT>(narrow_row<A>(partial, unit, n, col0), acc, team, lane, nv);
    if constexpr (LAYER)
      if (db_rows)
        store_narrow<A, VEC, VPT>(narrow_row<A>(partial_b, unit, n, col0), accb, team, lane, nv);
  }
  if (!wide_rows || !cached) return;
  if (iterations % FOLD_ROWS != 0 || iterations == 0) {
    if (prow)
      fold_rows<A, VEC, VPT>(weight_row(smem_raw, prow, teams), acc, teams, team_id, team, lane,
                             nv, iterations < FOLD_ROWS);
    if constexpr (LAYER)
      if (prow_b)
        fold_rows<A, VEC, VPT>(weight_row(smem_raw, prow_b, teams, b_at), accb, teams, team_id,
                               team, lane, nv, iterations < FOLD_ROWS);
  }
  if (teams > 1)  // the last fold ended with a barrier: every team's sums are in
    for (int c = threadIdx.x; c < nv * VEC; c += blockDim.x) {
      if (prow) {
        EMU_GLOBAL(prow + c, true);
        prow[c] = weight_row(smem_raw, prow, teams)[c];
      }
      if (prow_b) {
        EMU_GLOBAL(prow_b + c, true);
        prow_b[c] = weight_row(smem_raw, prow_b, teams, b_at)[c];
      }
    }
}

// dw[g * n + c] = sum over b in 0..blocks (blocks per group), in order, of partial[(g * blocks +
// b) * n + c], at the float64 level (`narrow`: the partials are float32, see rmsnorm_bwd_impl,
// each taken as 0.0 + its value: the bits of a float64 row holding it). Grid: ceil(n / 32)
// blocks per group g, groups one after the other. Block (32, 8): lane x owns a column, lane y the partial rows b = y, y + 8, ...;
// then the 8 sums are added in y order. Half-precision gradients are rounded through float32
// (within one unit of the correctly rounded sum).
template <typename A, typename W>
__device__ __forceinline__ void rmsnorm_bwd_finalize_impl(const Wide<A>* __restrict__ partial,
                                                          int blocks, int n, int narrow,
                                                          W* __restrict__ dw) {
  typedef Wide<A> S;
  const A* __restrict__ npartial = reinterpret_cast<const A*>(partial);
  __shared__ S sums[8][33];
  const int column_blocks = (n + 31) / 32;
  const i64 group = (i64)blockIdx.x / column_blocks;
  const int c = (int)((i64)blockIdx.x % column_blocks) * 32 + threadIdx.x;
  partial += group * blocks * (i64)n;
  npartial += group * blocks * (i64)n;
  dw += group * n;
  S s = S::zero();
  if (c < n) {
    // Four loads in flight before they are added (in the same order as one at a time: the
    // same bits): one load per thread at a time left the finalize a fifth of the backward's
    // time on an H200 by the traffic model (docs/gpu-traffic.md).
    int b = threadIdx.y;
    for (; b + 24 < blocks; b += 32) {
      S q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const i64 at = (i64)(b + 8 * i) * n + c;
        if (narrow) {
          EMU_GLOBAL(npartial + at, false);
          q[i] = S::zero();
          q[i].add(npartial[at]);
        } else {
          EMU_GLOBAL(partial + at, false);
          q[i] = partial[at];
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) s.merge(q[i]);
    }
    for (; b < blocks; b += 8) {
      const i64 at = (i64)b * n + c;
      S q = S::zero();
      if (narrow) {
        EMU_GLOBAL(npartial + at, false);
        q.add(npartial[at]);
      } else {
        EMU_GLOBAL(partial + at, false);
        q = partial[at];
      }
      s.merge(q);
    }
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
    S total = S::zero();
#pragma unroll
    for (int y = 0; y < 8; ++y) total.merge(sums[y][threadIdx.x]);
    EMU_GLOBAL(dw + c, true);
    dw[c] = Elem<W>::store((typename Elem<W>::Acc)total.value());
  }
}

// ------------------------------------------------------------------------------------------
// Entry points, stamped per (x dtype, weight dtype, vector width). Names:
//   rmsnorm_fwd_<x>_w<w>_<v|s>, rmsnorm_bwd_<x>_w<w>_<v|s|c>,
//   rmsnorm_residual_fwd_<x>_w<w>_<v|s>, rmsnorm_bwd_finalize_<acc>_w<w>;
//   LayerNorm's layernorm_fwd_<x>_w<w>_<v|s>, layernorm_bwd_<x>_w<w>_<v|s>,
//   layernorm_residual_fwd_<x>_w<w>_<v|s> (the same kernels with LAYER: a bias `b` of the
//   weight's dtype, the `mean` result or operand, the bias gradient's `partial_b`; no clusters;
//   the finalize is shared, once per gradient)
// `v`: 16-byte vectors (n % VEC == 0 and 16-byte aligned pointers), `s`: scalar accesses, `c`:
// the vector backward split across the blocks of a cluster (CLUSTER; `dots` null elsewhere).
// A null `w` means no weight; `offset` is the scale offset (-0.0 for none: weight_of), `dh` the
// backward's added gradient (null for none: store_dx). VPT (vectors cached per thread): forward
// 4 (blocks up to 1024 threads, 64 registers); backward 4, 8 for float32 (x and dy cached plus
// 32 accumulators per thread: blocks of 512 threads, one per SM, up to 128 registers), so rows
// up to 16384 elements (8192 for float64) are read once. LayerNorm's backward keeps a second
// set of accumulators (the bias's) and caches half as much: 4 vectors for float32, 2 for half
// precision and float64 (rows up to 8192 elements, 2048 for float64: at 4, ptxas spilled
// 60-68/120-132 bytes in float64's). VPT * VEC <= FOLD_ELEMS
// everywhere (one partial per row).
// ------------------------------------------------------------------------------------------
#define FWD_ENTRY(NAME, T, W, VEC, VPT)                                                       \
  extern "C" __global__ void FWD_BOUNDS NAME(                                                \
      const T* x, const W* w, T* y, Elem<T>::Acc* rstd, i64 rows, int n, int team,           \
      float eps, float offset, i64 rows_per_group) {                                        \
    rmsnorm_fwd<T, W, VEC, VPT, false, false>(x, nullptr, w, nullptr, y, nullptr, nullptr,    \
                                              rstd, rows, n, team, eps, offset,             \
                                              rows_per_group);                              \
  }

#define RES_ENTRY(NAME, T, W, VEC, VPT)                                                       \
  extern "C" __global__ void FWD_BOUNDS NAME(                                                \
      const T* x, const T* residual, const W* w, T* y, T* h, Elem<T>::Acc* rstd, i64 rows,   \
      int n, int team, float eps, float offset, i64 rows_per_group) {                       \
    rmsnorm_fwd<T, W, VEC, VPT, true, false>(x, residual, w, nullptr, y, h, nullptr, rstd,    \
                                             rows, n, team, eps, offset, rows_per_group);   \
  }

#define BWD_ENTRY(NAME, T, W, VEC, VPT, CLUSTER)                                              \
  extern "C" __global__ void __launch_bounds__(512, 1) NAME(                                \
      const T* x, const W* w, const Elem<T>::Acc* rstd, const T* dy, const T* dh, T* dx,     \
      Wide<Elem<T>::Acc>* partial, Wide<Elem<T>::Acc>* dots, int n, int team, float offset,  \
      i64 chunk, i64 rows_per_group, i64 blocks_per_group) {                                 \
    rmsnorm_bwd_impl<T, W, VEC, VPT, CLUSTER, false>(x, w, nullptr, rstd, dy, dh, dx,        \
                                                     partial, nullptr, dots, n, team, offset, \
                                                     chunk, rows_per_group,                  \
                                                     blocks_per_group);                      \
  }

#define LN_FWD_ENTRY(NAME, T, W, VEC, VPT)                                                    \
  extern "C" __global__ void FWD_BOUNDS NAME(                                                \
      const T* x, const W* w, const W* b, T* y, Elem<T>::Acc* mean, Elem<T>::Acc* rstd,      \
      i64 rows, int n, int team, float eps, float offset, i64 rows_per_group) {             \
    rmsnorm_fwd<T, W, VEC, VPT, false, true>(x, nullptr, w, b, y, nullptr, mean, rstd, rows,  \
                                             n, team, eps, offset, rows_per_group);         \
  }

#define LN_RES_ENTRY(NAME, T, W, VEC, VPT)                                                    \
  extern "C" __global__ void FWD_BOUNDS NAME(                                                \
      const T* x, const T* residual, const W* w, const W* b, T* y, T* h, Elem<T>::Acc* mean, \
      Elem<T>::Acc* rstd, i64 rows, int n, int team, float eps, float offset,               \
      i64 rows_per_group) {                                                                  \
    rmsnorm_fwd<T, W, VEC, VPT, true, true>(x, residual, w, b, y, h, mean, rstd, rows, n,     \
                                            team, eps, offset, rows_per_group);             \
  }

#define LN_BWD_ENTRY(NAME, T, W, VEC, VPT)                                                    \
  extern "C" __global__ void __launch_bounds__(512, 1) NAME(                                \
      const T* x, const W* w, const Elem<T>::Acc* mean, const Elem<T>::Acc* rstd,            \
      const T* dy, const T* dh, T* dx, Wide<Elem<T>::Acc>* partial,                          \
      Wide<Elem<T>::Acc>* partial_b, int n, int team, float offset, i64 chunk,               \
      i64 rows_per_group, i64 blocks_per_group) {                                            \
    rmsnorm_bwd_impl<T, W, VEC, VPT, false, true>(x, w, mean, rstd, dy, dh, dx, partial,     \
                                                  partial_b, nullptr, n, team, offset, chunk, \
                                                  rows_per_group, blocks_per_group);         \
  }

// LayerNorm's backward vectors per thread (see above; plan.rs's backward_vectors_per_thread).
#define LN_BWD_VPT(T) (sizeof(T) == 4 ? 4 : 2)

// KERNEL_NORMS: which norms' entry points a build stamps (a bit each): 1 the RMS norm's, 2
// LayerNorm's; the finalize kernels with either. kernels.rs compiles one module per norm (1 or
// 2), only when a call site of that norm needs it; the host emulator and the tests take both.
#if !defined(KERNEL_NORMS)
#if defined(__CUDACC_RTC__)
#define KERNEL_NORMS 1
#else
#define KERNEL_NORMS 3
#endif
#endif

#if KERNEL_NORMS & 1
#define STAMP_RMS(XN, T, WN, W)                                                               \
  FWD_ENTRY(rmsnorm_fwd_##XN##_w##WN##_v, T, W, (16 / sizeof(T)), FWD_VPT)                    \
  FWD_ENTRY(rmsnorm_fwd_##XN##_w##WN##_s, T, W, 1, FWD_VPT)                                   \
  BWD_ENTRY(rmsnorm_bwd_##XN##_w##WN##_v, T, W, (16 / sizeof(T)), (sizeof(T) == 4 ? 8 : 4), \
            false)                                                                            \
  BWD_ENTRY(rmsnorm_bwd_##XN##_w##WN##_s, T, W, 1, 4, false)                                  \
  RES_ENTRY(rmsnorm_residual_fwd_##XN##_w##WN##_v, T, W, (16 / sizeof(T)), FWD_VPT)           \
  RES_ENTRY(rmsnorm_residual_fwd_##XN##_w##WN##_s, T, W, 1, FWD_VPT)                          \
  BWD_ENTRY(rmsnorm_bwd_##XN##_w##WN##_c, T, W, (16 / sizeof(T)), (sizeof(T) == 4 ? 8 : 4), \
            true)
#else
#define STAMP_RMS(XN, T, WN, W)
#endif

#if KERNEL_NORMS & 2
#define STAMP_LAYER(XN, T, WN, W)                                                             \
  LN_FWD_ENTRY(layernorm_fwd_##XN##_w##WN##_v, T, W, (16 / sizeof(T)), FWD_VPT)              \
  LN_FWD_ENTRY(layernorm_fwd_##XN##_w##WN##_s, T, W, 1, FWD_VPT)                             \
  LN_BWD_ENTRY(layernorm_bwd_##XN##_w##WN##_v, T, W, (16 / sizeof(T)), LN_BWD_VPT(T))        \
  LN_BWD_ENTRY(layernorm_bwd_##XN##_w##WN##_s, T, W, 1, 4)                                   \
  LN_RES_ENTRY(layernorm_residual_fwd_##XN##_w##WN##_v, T, W, (16 / sizeof(T)), FWD_VPT)     \
  LN_RES_ENTRY(layernorm_residual_fwd_##XN##_w##WN##_s, T, W, 1, FWD_VPT)
#else
#define STAMP_LAYER(XN, T, WN, W)
#endif

#define STAMP(XN, T, WN, W) STAMP_RMS(XN, T, WN, W) STAMP_LAYER(XN, T, WN, W)

#define FINALIZE_ENTRY(AN, A, WN, W)                                                          \
  extern "C" __global__ void __launch_bounds__(256) rmsnorm_bwd_finalize_##AN##_w##WN(        \
      const Wide<A>* partial, int blocks, int n, int narrow, W* dw) {                         \
    rmsnorm_bwd_finalize_impl<A, W>(partial, blocks, n, narrow, dw);                          \
  }

// Every (x, weight) pair of the op contract (src/handlers/contract.rs: any of the four floats
// for x with any of them for the weight; kernels.rs's table lists the same names, and its
// tests and tests/gpu_kernels.rs check them against this file and its PTX).
#define STAMP_WEIGHTS(XN, T)                                                                  \
  STAMP(XN, T, f32, float)                                                                    \
  STAMP(XN, T, f64, double)                                                                   \
  STAMP(XN, T, bf16, bf16_t)                                                                  \
  STAMP(XN, T, f16, f16_t)

// A finalize per (accumulator, weight) pair the contract yields: float32 sums (x float32,
// bfloat16, float16) and float64 sums (x float64), each with every weight dtype.
#define FINALIZE_WEIGHTS(AN, A)                                                               \
  FINALIZE_ENTRY(AN, A, f32, float)                                                           \
  FINALIZE_ENTRY(AN, A, f64, double)                                                          \
  FINALIZE_ENTRY(AN, A, bf16, bf16_t)                                                         \
  FINALIZE_ENTRY(AN, A, f16, f16_t)

// EMU_PAIRS (tests only): a host build of the emulator that runs a few pairs (ThreadSanitizer's,
// the traffic model's, the planted bugs') names the STAMP and FINALIZE_ENTRY lines it needs, and
// compiles only their kernels (the whole table is 216: 13 per pair, 8 finalizes). Never defined
// for the device.
#if defined(EMU_PAIRS)
EMU_PAIRS
#else
STAMP_WEIGHTS(f32, float)
STAMP_WEIGHTS(f64, double)
STAMP_WEIGHTS(bf16, bf16_t)
STAMP_WEIGHTS(f16, f16_t)

FINALIZE_WEIGHTS(f32, float)
FINALIZE_WEIGHTS(f64, double)
#endif
