// A standalone run of the emulated kernels for the sanitizers (`make gpu-sanitize`): every
// kernel family (LayerNorm's a sample) over shapes and over every team size the kernels accept (not only the ones
// the Rust launch plan picks), with buffers of exactly the sizes a launch may touch (malloc, so
// AddressSanitizer's redzones sit right behind them), each result checked against float64.
//
// Why not through the Rust bundles: ThreadSanitizer cannot see through an uninstrumented Rust
// host, and a standalone program keeps the sanitizer build small. Under ThreadSanitizer the
// scheduler reports accesses of two CUDA threads that no barrier orders (see fibers.cpp).
//
// Usage: harness [quick|one|layer]   (none: the RMS norm's full sweep; quick: the subset run
// under ThreadSanitizer, both norms; one: a single multi-warp forward and backward, for checking
// that a planted race is reported; layer: LayerNorm's sample, from a build of its pairs)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "emulator.h"
#include "kernel_args.h"

// The norms whose kernels the build stamps, as rmsnorm.cu defaults them for host builds
// (sanitize.sh passes the same -DKERNEL_NORMS to every file of a build): the LayerNorm sample
// runs only where its kernels exist.
#ifndef KERNEL_NORMS
#define KERNEL_NORMS 3
#endif

namespace {

enum Type { F32, F64, BF16, F16 };
const char* kName[] = {"f32", "f64", "bf16", "f16"};
size_t bytes_of(Type t) { return t == F64 ? 8 : t == F32 ? 4 : 2; }
Type acc_of(Type t) { return t == F64 ? F64 : F32; }
// Bytes of the kernels' Wide<acc> (the weight-gradient partials): a float64, or two.
size_t wide_bytes_of(Type acc) { return acc == F64 ? 16 : 8; }

unsigned f2u(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}
float u2f(unsigned u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
unsigned short to_bf16(float f) {
  unsigned u = f2u(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

// Element i of a buffer of type t, as a double.
double get(Type t, const void* p, size_t i) {
  switch (t) {
    case F32: return ((const float*)p)[i];
    case F64: return ((const double*)p)[i];
    case BF16: return u2f((unsigned)((const unsigned short*)p)[i] << 16);
    default: return emu_f16_to_f32(((const unsigned short*)p)[i]);
  }
}
void set(Type t, void* p, size_t i, double v) {
  switch (t) {
    case F32: ((float*)p)[i] = (float)v; break;
    case F64: ((double*)p)[i] = v; break;
    case BF16: ((unsigned short*)p)[i] = to_bf16((float)v); break;
    default: ((unsigned short*)p)[i] = emu_f32_to_f16((float)v); break;
  }
}

struct Buffer {
  void* p = nullptr;
  Buffer(size_t bytes) { p = malloc(bytes ? bytes : 1); memset(p, 0xff, bytes); }
  ~Buffer() { free(p); }
  Buffer(const Buffer&) = delete;
  uint64_t addr() const { return (uint64_t)(uintptr_t)p; }
};

using emu_args::find;
using emu_args::pack;

uint64_t seed = 1;
int failures = 0, launches = 0;

void launch(const emu::Kernel* k, unsigned grid, emu::Dim block, unsigned smem,
            const std::vector<uint64_t>& values, unsigned cluster = 1) {
  std::vector<unsigned char> params = pack(k, values);
  char message[1024];
  ++launches;
  if (emu_run_grid(k, emu::Dim{grid, 1, 1}, block, cluster, smem, params.data(), seed++, message,
                   sizeof message) != 0) {
    fprintf(stderr, "EMULATOR ERROR in %s: %s\n", k->name, message);
    ++failures;
  }
}

double rnd(uint64_t& s) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(s >> 40) / (double)(1ull << 24) * 4.0 - 2.0;
}

void check(const char* what, const std::string& tag, Type t, const void* got,
           const std::vector<double>& want, double tol) {
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = get(t, got, i);
    if (!(fabs(g - want[i]) <= tol * (1.0 + fabs(want[i])))) {
      fprintf(stderr, "MISMATCH %s %s [%zu]: got %g, want %g\n", what, tag.c_str(), i, g, want[i]);
      ++failures;
      return;
    }
  }
}

double tolerance(Type t) { return t == F64 ? 1e-12 : t == F32 ? 2e-5 : t == BF16 ? 3e-2 : 4e-3; }

// One forward and one backward (+ finalize) of `groups` x `rows_per_group` rows of n, with the
// weight applied as `offset + w` (0: none; the kernels then get -0.0, as the launch code passes)
// and, with `with_dh`, a dh added to dx. With `cluster` > 1, the backward alone (rstd from the
// float64 reference) in its `_c` kernel, rows split across clusters of that many blocks (the
// vector path, one team of 512, each block's slice of the row cached).
void run_case(Type xt, Type wt, bool weight, bool vec, size_t groups, size_t rpg, int n,
              int fwd_team, int bwd_team, int max_blocks, float offset, bool with_dh,
              int cluster = 1) {
  const size_t rows = groups * rpg, count = rows * (size_t)n;
  const Type at = acc_of(xt);
  const int VEC = vec ? (int)(16 / bytes_of(xt)) : 1;
  if (n % VEC) return;
  char name[128];
  std::string tag = std::string(kName[xt]) + " w=" + (weight ? kName[wt] : "none") +
                    (vec ? " vec" : " scalar") + " groups=" + std::to_string(groups) +
                    " rows=" + std::to_string(rpg) + " n=" + std::to_string(n) +
                    " teams=" + std::to_string(fwd_team) + "/" + std::to_string(bwd_team) +
                    " offset=" + std::to_string(offset) + (with_dh ? " dh" : "") +
                    (cluster > 1 ? " cluster=" + std::to_string(cluster) : "");
  const uint64_t offset_bits = f2u(offset != 0.0f ? offset : -0.0f);
  Buffer x(count * bytes_of(xt)), dy(count * bytes_of(xt)), y(count * bytes_of(xt)),
      dx(count * bytes_of(xt)), rstd(rows * bytes_of(at)),
      w(weight ? groups * n * bytes_of(wt) : 0), dw(weight ? groups * n * bytes_of(wt) : 0),
      res(count * bytes_of(xt)), h(count * bytes_of(xt)), hy(count * bytes_of(xt)),
      hrstd(rows * bytes_of(at)), dh(with_dh ? count * bytes_of(xt) : 0);
  uint64_t s = seed * 7919;
  for (size_t i = 0; i < count; ++i) set(xt, x.p, i, rnd(s)), set(xt, dy.p, i, rnd(s));
  for (size_t i = 0; i < count; ++i) set(xt, res.p, i, rnd(s));
  if (with_dh)
    for (size_t i = 0; i < count; ++i) set(xt, dh.p, i, rnd(s));
  // The weight the kernels apply: offset + w (the offset taken as the float32 it travels as).
  auto weight_at = [&](size_t i) { return weight ? (double)offset + get(wt, w.p, i) : 1.0; };
  if (weight)
    for (size_t i = 0; i < groups * n; ++i) set(wt, w.p, i, 1.0 + 0.25 * rnd(s));
  // float64 reference from the rounded inputs.
  std::vector<double> ry(count), rr(rows), rdx(count), rdw(weight ? groups * n : 0, 0.0);
  for (size_t r = 0; r < rows; ++r) {
    const size_t g = r / rpg;
    double ss = 0;
    for (int j = 0; j < n; ++j) ss += get(xt, x.p, r * n + j) * get(xt, x.p, r * n + j);
    const double rs = 1.0 / sqrt(ss / n + (double)1e-5f);  // eps travels as a float32
    rr[r] = rs;
    double dot = 0;
    for (int j = 0; j < n; ++j) {
      const double wj = weight_at(g * n + j);
      dot += get(xt, dy.p, r * n + j) * wj * get(xt, x.p, r * n + j);
    }
    for (int j = 0; j < n; ++j) {
      const double wj = weight_at(g * n + j);
      const double xv = get(xt, x.p, r * n + j), gv = get(xt, dy.p, r * n + j);
      ry[r * n + j] = xv * rs * wj;
      rdx[r * n + j] = rs * gv * wj - xv * rs * rs * rs * dot / n +
                       (with_dh ? get(xt, dh.p, r * n + j) : 0.0);
      if (weight) rdw[g * n + j] += gv * xv * rs;
    }
  }
  const char* wn = weight ? kName[wt] : kName[xt];
  const double tol = tolerance(xt);
  if (cluster > 1)
    for (size_t r = 0; r < rows; ++r) set(at, rstd.p, r, rr[r]);
  // Forward: teams of fwd_team threads, blocks of max(team, 256).
  const unsigned fblock = fwd_team > 256 ? fwd_team : 256;
  const size_t fteams = fblock / fwd_team;
  snprintf(name, sizeof name, "rmsnorm_fwd_%s_w%s_%s", kName[xt], wn, vec ? "v" : "s");
  if (rows > 0 && cluster == 1) {
    launch(find(name), (unsigned)((rows + fteams - 1) / fteams), emu::Dim{fblock, 1, 1}, 0,
           {x.addr(), weight ? w.addr() : 0, y.addr(), rstd.addr(), rows, (uint64_t)n,
            (uint64_t)fwd_team, f2u(1e-5f), offset_bits, rpg});
    check("y", tag, xt, y.p, ry, tol);
    check("rstd", tag, at, rstd.p, rr, tol);
    // The fused residual forward: h = x + residual rounded to xt (bit for bit), its norm.
    snprintf(name, sizeof name, "rmsnorm_residual_fwd_%s_w%s_%s", kName[xt], wn, vec ? "v" : "s");
    launch(find(name), (unsigned)((rows + fteams - 1) / fteams), emu::Dim{fblock, 1, 1}, 0,
           {x.addr(), res.addr(), weight ? w.addr() : 0, hy.addr(), h.addr(), hrstd.addr(), rows,
            (uint64_t)n, (uint64_t)fwd_team, f2u(1e-5f), offset_bits, rpg});
    Buffer want_h(count * bytes_of(xt));
    for (size_t i = 0; i < count; ++i)
      set(xt, want_h.p, i, get(xt, x.p, i) + get(xt, res.p, i));
    if (memcmp(h.p, want_h.p, count * bytes_of(xt)) != 0) {
      fprintf(stderr, "MISMATCH h %s: not x + residual rounded\n", tag.c_str());
      ++failures;
    }
    std::vector<double> rhy(count);
    for (size_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int j = 0; j < n; ++j) ss += get(xt, h.p, r * n + j) * get(xt, h.p, r * n + j);
      const double rs = 1.0 / sqrt(ss / n + (double)1e-5f);
      for (int j = 0; j < n; ++j) {
        const double wj = weight_at((r / rpg) * n + j);
        rhy[r * n + j] = get(xt, h.p, r * n + j) * rs * wj;
      }
    }
    check("residual y", tag, xt, hy.p, rhy, tol);
  }
  // Backward: blocks of 512, bwd_team threads per row, up to max_blocks per group.
  const int vpt = (vec && bytes_of(xt) == 4) ? 8 : 4;
  const int teams = 512 / bwd_team;
  const bool cached = n / VEC / cluster <= bwd_team * vpt;
  if (!cached && bwd_team != 512) return;  // the streaming path takes one team per block
  if (cluster > 1 && (!vec || bwd_team != 512 || (n / VEC) % cluster != 0)) return;
  const unsigned smem = (teams > 1 && cached) ? n * (unsigned)wide_bytes_of(at) : 0;
  size_t bpg = rpg ? (rpg + teams - 1) / teams : 1;
  if (bpg > (size_t)max_blocks) bpg = max_blocks;
  const size_t chunk = rpg ? (rpg + bpg - 1) / bpg : 1;
  bpg = rpg ? (rpg + chunk - 1) / chunk : 1;
  // A partial row per block, or per cluster (bpg: blocks, or clusters, per group); a cluster's
  // blocks have two dot-product slots each.
  Buffer partial(weight ? groups * bpg * n * wide_bytes_of(at) : 0);
  Buffer dots(cluster > 1 ? groups * bpg * cluster * 2 * wide_bytes_of(at) : 0);
  snprintf(name, sizeof name, "rmsnorm_bwd_%s_w%s_%s", kName[xt], wn,
           cluster > 1 ? "c" : vec ? "v" : "s");
  if (rows > 0) {
    launch(find(name), (unsigned)(groups * bpg * cluster), emu::Dim{512, 1, 1}, smem,
           {x.addr(), weight ? w.addr() : 0, rstd.addr(), dy.addr(), with_dh ? dh.addr() : 0,
            dx.addr(), weight ? partial.addr() : 0, cluster > 1 ? dots.addr() : 0, (uint64_t)n,
            (uint64_t)bwd_team, offset_bits, chunk, rpg, bpg},
           (unsigned)cluster);
    check("dx", tag, xt, dx.p, rdx, tol * 4);
  }
  if (weight) {
    snprintf(name, sizeof name, "rmsnorm_bwd_finalize_%s_w%s", kName[at], kName[wt]);
    // Narrow (float32) partial rows: one team per block, chunks of at most 8 rows (rmsnorm.cu).
    const bool narrow = at == F32 && teams == 1 && chunk <= 8;
    launch(find(name), (unsigned)(groups * ((n + 31) / 32)), emu::Dim{32, 8, 1}, 0,
           {partial.addr(), rows ? bpg : 0, (uint64_t)n, (uint64_t)narrow, dw.addr()});
    const double dw_tol = tolerance(wt) > tolerance(xt) ? tolerance(wt) : tolerance(xt);
    check("dw", tag, wt, dw.p, rdw, dw_tol * 4 * sqrt((double)rpg + 1));
  }
}

// LayerNorm's kernels (rmsnorm.cu's layernorm_*): a forward with the weight (or none) and a bias
// (or none), its fused residual forward, then the backward given the forward's mean and rstd
// and the finalize of each gradient (the weight's partial rows, then the bias's after them in
// the same scratch, as plan.rs lays them out), against float64. x's rows have mean `shift`.
void run_layer_case(Type xt, Type wt, bool weight, bool bias, bool vec, size_t groups,
                    size_t rpg, int n, int fwd_team, int bwd_team, int max_blocks, float offset,
                    double shift) {
  const size_t rows = groups * rpg, count = rows * (size_t)n;
  const Type at = acc_of(xt);
  const int VEC = vec ? (int)(16 / bytes_of(xt)) : 1;
  if (n % VEC) return;
  char name[128];
  std::string tag = std::string("layer ") + kName[xt] + " w=" + (weight ? kName[wt] : "none") +
                    (bias ? " bias" : "") + (vec ? " vec" : " scalar") +
                    " groups=" + std::to_string(groups) + " rows=" + std::to_string(rpg) +
                    " n=" + std::to_string(n) + " teams=" + std::to_string(fwd_team) + "/" +
                    std::to_string(bwd_team) + " offset=" + std::to_string(offset) +
                    " mean=" + std::to_string(shift);
  const uint64_t offset_bits = f2u(offset != 0.0f ? offset : -0.0f);
  const size_t wbytes = groups * n * bytes_of(wt);
  Buffer x(count * bytes_of(xt)), dy(count * bytes_of(xt)), y(count * bytes_of(xt)),
      dx(count * bytes_of(xt)), mean(rows * bytes_of(at)), rstd(rows * bytes_of(at)),
      w(weight ? wbytes : 0), b(bias ? wbytes : 0), dw(weight ? wbytes : 0), db(bias ? wbytes : 0),
      res(count * bytes_of(xt)), h(count * bytes_of(xt)), hy(count * bytes_of(xt)),
      hmean(rows * bytes_of(at)), hrstd(rows * bytes_of(at));
  uint64_t s = seed * 7919;
  for (size_t i = 0; i < count; ++i) set(xt, x.p, i, shift + rnd(s)), set(xt, dy.p, i, rnd(s));
  for (size_t i = 0; i < count; ++i) set(xt, res.p, i, rnd(s));
  if (weight)
    for (size_t i = 0; i < groups * n; ++i) set(wt, w.p, i, 1.0 + 0.25 * rnd(s));
  if (bias)
    for (size_t i = 0; i < groups * n; ++i) set(wt, b.p, i, 0.5 * rnd(s));
  auto weight_at = [&](size_t i) { return weight ? (double)offset + get(wt, w.p, i) : 1.0; };
  auto bias_at = [&](size_t i) { return bias ? get(wt, b.p, i) : 0.0; };
  // float64 reference of rows `src` (x, or h): y, mean, rstd; and the backward's dx, dw, db.
  auto forward_ref = [&](const void* src, std::vector<double>& ry, std::vector<double>& rm,
                         std::vector<double>& rr) {
    for (size_t r = 0; r < rows; ++r) {
      double m = 0, v = 0;
      for (int j = 0; j < n; ++j) m += get(xt, src, r * n + j);
      m /= n;
      for (int j = 0; j < n; ++j) v += (get(xt, src, r * n + j) - m) * (get(xt, src, r * n + j) - m);
      const double rs = 1.0 / sqrt(v / n + (double)1e-5f);
      rm[r] = m, rr[r] = rs;
      for (int j = 0; j < n; ++j)
        ry[r * n + j] = (get(xt, src, r * n + j) - m) * rs * weight_at((r / rpg) * n + j) +
                        bias_at((r / rpg) * n + j);
    }
  };
  std::vector<double> ry(count), rm(rows), rr(rows), rdx(count), rdw(groups * n, 0.0),
      rdb(groups * n, 0.0);
  forward_ref(x.p, ry, rm, rr);
  for (size_t r = 0; r < rows; ++r) {
    const size_t g = r / rpg;
    double mg = 0, mgx = 0;
    for (int j = 0; j < n; ++j) {
      const double xh = (get(xt, x.p, r * n + j) - rm[r]) * rr[r];
      const double gv = get(xt, dy.p, r * n + j) * weight_at(g * n + j);
      mg += gv, mgx += gv * xh;
    }
    mg /= n, mgx /= n;
    for (int j = 0; j < n; ++j) {
      const double xh = (get(xt, x.p, r * n + j) - rm[r]) * rr[r];
      const double dv = get(xt, dy.p, r * n + j);
      rdx[r * n + j] = rr[r] * (dv * weight_at(g * n + j) - mg - xh * mgx);
      rdw[g * n + j] += dv * xh;
      rdb[g * n + j] += dv;
    }
  }
  const char* wn = (weight || bias) ? kName[wt] : kName[xt];
  const double tol = tolerance(xt);
  const unsigned fblock = fwd_team > 256 ? fwd_team : 256;
  const size_t fteams = fblock / fwd_team;
  if (rows > 0) {
    snprintf(name, sizeof name, "layernorm_fwd_%s_w%s_%s", kName[xt], wn, vec ? "v" : "s");
    launch(find(name), (unsigned)((rows + fteams - 1) / fteams), emu::Dim{fblock, 1, 1}, 0,
           {x.addr(), weight ? w.addr() : 0, bias ? b.addr() : 0, y.addr(), mean.addr(),
            rstd.addr(), rows, (uint64_t)n, (uint64_t)fwd_team, f2u(1e-5f), offset_bits, rpg});
    check("layer y", tag, xt, y.p, ry, tol);
    check("layer rstd", tag, at, rstd.p, rr, tol);
    snprintf(name, sizeof name, "layernorm_residual_fwd_%s_w%s_%s", kName[xt], wn, vec ? "v" : "s");
    launch(find(name), (unsigned)((rows + fteams - 1) / fteams), emu::Dim{fblock, 1, 1}, 0,
           {x.addr(), res.addr(), weight ? w.addr() : 0, bias ? b.addr() : 0, hy.addr(), h.addr(),
            hmean.addr(), hrstd.addr(), rows, (uint64_t)n, (uint64_t)fwd_team, f2u(1e-5f),
            offset_bits, rpg});
    std::vector<double> rhy(count), rhm(rows), rhr(rows);
    forward_ref(h.p, rhy, rhm, rhr);
    check("layer residual y", tag, xt, hy.p, rhy, tol);
  }
  // Backward: blocks of 512, LayerNorm's vectors per thread (rmsnorm.cu's LN_BWD_VPT).
  const int vpt = vec && bytes_of(xt) != 4 ? 2 : 4;
  const int teams = 512 / bwd_team;
  const bool cached = n / VEC <= bwd_team * vpt;
  if (!cached && bwd_team != 512) return;  // the streaming path takes one team per block
  const int grads = (int)weight + (int)bias;
  const unsigned smem =
      (teams > 1 && cached) ? (grads ? grads : 1) * n * (unsigned)wide_bytes_of(at) : 0;
  size_t bpg = rpg ? (rpg + teams - 1) / teams : 1;
  if (bpg > (size_t)max_blocks) bpg = max_blocks;
  const size_t chunk = rpg ? (rpg + bpg - 1) / bpg : 1;
  bpg = rpg ? (rpg + chunk - 1) / chunk : 1;
  const size_t row_bytes = groups * bpg * n * wide_bytes_of(at);
  Buffer partial(grads * row_bytes);
  const uint64_t pw = weight ? partial.addr() : 0;
  const uint64_t pb = bias ? partial.addr() + (weight ? row_bytes : 0) : 0;
  if (rows > 0) {
    snprintf(name, sizeof name, "layernorm_bwd_%s_w%s_%s", kName[xt], wn, vec ? "v" : "s");
    launch(find(name), (unsigned)(groups * bpg), emu::Dim{512, 1, 1}, smem,
           {x.addr(), weight ? w.addr() : 0, mean.addr(), rstd.addr(), dy.addr(), 0, dx.addr(),
            pw, pb, (uint64_t)n, (uint64_t)bwd_team, offset_bits, chunk, rpg, bpg});
    check("layer dx", tag, xt, dx.p, rdx, tol * 4);
  }
  const bool narrow = at == F32 && teams == 1 && chunk <= 8;
  const double gtol = (tolerance(wt) > tol ? tolerance(wt) : tol) * 4 * sqrt((double)rpg + 1);
  snprintf(name, sizeof name, "rmsnorm_bwd_finalize_%s_w%s", kName[at], wn);
  if (weight) {
    launch(find(name), (unsigned)(groups * ((n + 31) / 32)), emu::Dim{32, 8, 1}, 0,
           {pw, rows ? bpg : 0, (uint64_t)n, (uint64_t)narrow, dw.addr()});
    check("layer dw", tag, wt, dw.p, rdw, gtol);
  }
  if (bias) {
    launch(find(name), (unsigned)(groups * ((n + 31) / 32)), emu::Dim{32, 8, 1}, 0,
           {pb, rows ? bpg : 0, (uint64_t)n, (uint64_t)narrow, db.addr()});
    check("layer db", tag, wt, db.p, rdb, gtol);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && !strcmp(argv[1], "quick");
  const bool layer_only = argc > 1 && !strcmp(argv[1], "layer");
  const bool rms = !layer_only, layer = (KERNEL_NORMS & 2) && (quick || layer_only);
  if (argc > 1 && !strcmp(argv[1], "one")) {
    run_case(F32, F32, true, true, 1, 3, 2048, 512, 512, 2, 0.0f, false);
    printf("harness: 1 case, %d launches, %d failures\n", launches, failures);
    return failures ? 1 : 0;
  }
  struct Shape { size_t groups, rows; int n; };
  const Shape full[] = {{1, 3, 8}, {1, 5, 1}, {1, 9, 67}, {1, 4, 512}, {3, 2, 64},
                        {1, 2, 4096}, {1, 1, 20000}, {2, 0, 16}};
  const Shape small[] = {{1, 9, 64}, {1, 2, 2048}, {2, 3, 256}};
  // 4: forward teams under a warp (several rows per warp; the backward keeps 32).
  const int teams[] = {4, 32, 64, 512};
  // The scale offsets and dh the cases take in turn (every path and width meets each): none,
  // Gemma's 1 with dh, -0.5.
  const float offsets[] = {0.0f, 1.0f, -0.5f};
  int cases = 0;
  // Every x dtype with every weight dtype (the contract's 16 pairs), and without a weight (one
  // pass per x dtype: the kernels then read no weight). A weight of x's dtype or float32 takes
  // every path and team size; the other weights (bfloat16 or float16 next to float32, float64
  // next to narrower x...) differ from those only in the width of the weight's packs, and take
  // the vector path (the scalar one reads one weight element per access whatever its dtype)
  // with the smallest and the largest teams on every shape: the ASan run stays within the time
  // of the 7 pairs before (the harness at 6f80d76: 76 s on 2 cores).
  for (int xi = 0; xi < (rms ? 4 : 0); ++xi)
    for (int wi = -1; wi < 4; ++wi) {
      const Type xt = (Type)xi, wt = wi < 0 ? xt : (Type)wi;
      const bool weight = wi >= 0;
      const bool every_team = wt == xt || wt == F32;
      if (quick && !(xt == F32 && wt == F32 && weight) && !(xt == BF16 && wt == F32 && weight))
        continue;
      for (const Shape& s : (quick ? std::vector<Shape>(small, small + 3)
                                   : std::vector<Shape>(full, full + 8)))
        for (int vec = 0; vec < 2; ++vec)
          for (int team : teams) {
            if (quick && (team == 64 || vec == 0)) continue;
            if (!every_team && (team == 32 || team == 64 || vec == 0)) continue;
            const int turn = cases % 3;
            run_case(xt, wt, weight, vec, s.groups, s.rows, s.n, team > 256 ? 1024 : team,
                     team < 32 ? 32 : team, quick ? 2 : 3, offsets[turn], turn == 1);
            ++cases;
            // The backward split across clusters of 2 and 4 blocks (AddressSanitizer's sweep
            // only: ThreadSanitizer would see the static shared memory the emulator swaps
            // between a cluster's blocks as shared by them).
            if (!quick && every_team && vec && team == 512)
              for (int cluster : {2, 4}) {
                run_case(xt, wt, weight, vec, s.groups, s.rows, s.n, 1024, 512, 3,
                         offsets[turn], turn == 1, cluster);
                ++cases;
              }
          }
    }
  // LayerNorm: a sample, not the whole sweep again (its kernels are the same code with a
  // mean): float32 and bfloat16 x with a float32 weight and a bias, and without either; float64
  // and float16 with their own dtype's (sanitize.sh's `layer_pairs`); the scalar and vector
  // paths, teams from under a warp to a block, several rows per team (the bias's partial row
  // beside the weight's in shared memory), batched weights, streaming rows, and rows of mean
  // 1e4.
  const Shape layer_full[] = {{1, 9, 67}, {1, 40, 256}, {3, 2, 64}, {1, 2, 20000}, {2, 0, 16}};
  const Shape layer_small[] = {{1, 9, 64}, {2, 3, 256}};
  struct Pair { Type x, w; bool weight, bias; };
  const Pair layer_pairs[] = {{F32, F32, true, true}, {BF16, F32, true, true},
                              {BF16, BF16, false, false}, {F64, F64, true, true},
                              {F16, F16, false, true}};
  // Under ThreadSanitizer float32 alone (its cases take seconds each there); the streaming
  // rows with the block-wide team alone (smaller teams stream the forward a few lanes at a time:
  // minutes under AddressSanitizer for nothing the other shapes do not check); the scalar path
  // with float32 alone (its loads and stores are the RMS norm's, which the sweep takes through
  // every pair; what LayerNorm adds, the mean, the shift and the bias's partial row, is the
  // same code on either path: 130 cases before, 78 now).
  for (const Pair& p : layer_pairs) {
    if (!layer || (quick && p.x != F32)) continue;
    for (const Shape& s : (quick ? std::vector<Shape>(layer_small, layer_small + 2)
                                 : std::vector<Shape>(layer_full, layer_full + 5)))
      for (int vec = quick || p.x != F32 ? 1 : 0; vec < 2; ++vec)
        for (int team : teams) {
          if (team == 64 || (s.n > 4096 && team != 512)) continue;
          const int turn = cases % 3;
          run_layer_case(p.x, p.w, p.weight, p.bias, vec, s.groups, s.rows, s.n,
                         team > 256 ? 1024 : team, team < 32 ? 32 : team, quick ? 2 : 3,
                         offsets[turn], p.x == F32 && turn == 2 ? 1e4 : 0.0);
          ++cases;
        }
  }
  printf("harness: %d cases, %d launches, %d failures\n", cases, launches, failures);
  return failures ? 1 : 0;
}
