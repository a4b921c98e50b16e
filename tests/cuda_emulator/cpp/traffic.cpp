// The traffic harness of `make gpu-traffic` (tests/cuda_emulator/traffic.py drives it): runs the
// RMS norm kernels on the emulator, built with EMU_TRAFFIC so that every global access the
// kernel source marks (EMU_GLOBAL in rmsnorm.cu: the vector and scalar loads and stores of
// x/dy/residual/w/y/dx/h, rstd, the weight-gradient partials and dw) is recorded here, and prints
// per launch, as one JSON line per call:
// - bytes requested, reads and writes per buffer, and warp-level instructions;
// - 32-byte sectors per warp-level access: the accesses of the 32 lanes of a warp at the same
//   source line, to the same buffer, the k-th time since the warp's last barrier or shuffle
//   (lanes pass those together: the emulator checks it), are one instruction;
// - the widths of those accesses (the type's alignment, up to 16 bytes);
// - distinct sectors touched per buffer over the launch (what reaches DRAM if nothing is
//   fetched twice);
// - load bytes a thread issues between two barriers/shuffles (its independent loads of a row on
//   the cached paths).
//
// Launch geometry: plan_forward / plan_backward below re-derive src/handlers/gpu/plan.rs
// (forward_launch, backward_launch, 132 SMs); traffic.py writes every plan it ran to
// docs/gpu-traffic-plans.txt, which plan.rs's unit test checks against the Rust functions.
//
// Only some blocks run: the first `max_blocks` and the last of each grid (blocks of a launch
// do the same work, but for the last, which may hold fewer rows); the counts of the first are
// scaled to the grid (per-row buffers) or taken as they are (the weight, read by every block:
// its distinct sectors do not grow with the grid). All of them when the grid is small.
//
// Usage: traffic [max_blocks [forward_min_team]] < lines of "kind dtype n rows" (kind
// fwd|res|bwd|bwdh, bwdh: the backward with dh, the fused residual's, and a scale offset of 1;
// LayerNorm's lnf|lnres|lnb, with a weight and a bias; dtype f32|bf16|f16|f64; the weight (and
// bias) of x's dtype).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_shim.h"
#include "emulator.h"
#include "kernel_args.h"

namespace {

constexpr int kSms = 132;  // an H200's (and an H100 SXM's) multiprocessors
constexpr int kMaxCluster = 8;  // plan.rs's MAX_CLUSTER: an H200 (compute capability 9.0) has clusters

struct Dir {
  // requested: bytes the lanes asked for; useful: the same without lanes that read an address
  // another lane of the instruction reads too (a broadcast); sectors: distinct 32-byte sectors
  // per warp instruction, summed; unique: bytes of the distinct sectors touched in the launch.
  uint64_t requested = 0, useful = 0, instructions = 0, sectors = 0, unique = 0;
  uint64_t widths[5] = {0, 0, 0, 0, 0};  // instructions of 1, 2, 4, 8, 16 bytes per lane
  void add(const Dir& o, double scale) {
    requested += (uint64_t)llround(o.requested * scale);
    useful += (uint64_t)llround(o.useful * scale);
    instructions += (uint64_t)llround(o.instructions * scale);
    sectors += (uint64_t)llround(o.sectors * scale);
    unique += (uint64_t)llround(o.unique * scale);
    for (int i = 0; i < 5; ++i) widths[i] += (uint64_t)llround(o.widths[i] * scale);
  }
};

struct Buffer {
  std::string name;
  uintptr_t lo = 0, hi = 0;
  bool broadcast = false;   // read by every block (the weight): distinct sectors not scaled
  bool row = false;         // a row array (x, residual, dy, dh): its loads count per step
  bool l2 = false;          // written and read back within the launch (a cluster's dot slots):
                            // its loads are L2 round trips after a barrier, not loads in flight
  Dir group[2][2];          // [head blocks, last block][read, write]
  std::vector<uint8_t> seen[2];  // distinct sectors touched, per direction
};

struct Key {
  int warp, epoch, line, buffer, store, count;
  bool operator==(const Key& o) const {
    return warp == o.warp && epoch == o.epoch && line == o.line && buffer == o.buffer &&
           store == o.store && count == o.count;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = (uint64_t)k.warp * 0x9e3779b97f4a7c15ull;
    h ^= (uint64_t)k.epoch * 0xbf58476d1ce4e5b9ull + (h << 6) + (h >> 2);
    h ^= (uint64_t)(k.line * 64 + k.buffer * 2 + k.store) * 0x94d049bb133111ebull + (h >> 3);
    h ^= (uint64_t)k.count + (h << 7);
    return (size_t)h;
  }
};
struct Instance {
  std::vector<uint64_t> sectors;
  std::vector<uint64_t> addresses;  // of the lanes' pieces: lanes reading one address count once
  uint64_t bytes = 0;
  unsigned width = 0;
};

struct Thread {
  int epoch = 0;
  std::unordered_map<uint64_t, int> counts;  // (line, buffer, store) -> accesses this epoch
  uint64_t load_bytes = 0, max_load_bytes = 0;
  uint64_t step_bytes = 0, max_step_bytes = 0;  // row loads per streaming step (EMU_STEP)
};

// What is recorded of one running block: a cluster's blocks run together (slot: the block's
// rank in its cluster, 0 without clusters).
struct Slot {
  std::vector<Thread> threads;
  std::unordered_map<Key, Instance, KeyHash> instances;
  int group = 0;  // head blocks (0) or the last cluster (1)
};

struct Recorder {
  std::vector<Buffer> buffers;
  std::vector<Slot> slots;
  int current = 0;           // the running block's slot
  uint64_t head_blocks = 0;  // run blocks [0, head_blocks) and the last cluster's
  uint64_t cluster = 1;      // blocks per cluster of the launch
  // Load bytes of a block's threads between two syncs (each thread's most over its epochs,
  // summed over the block; the weight, read from cache, left out), over the blocks run.
  double inflight_sum = 0;
  uint64_t inflight_blocks = 0;
  // Row loads a block's threads issue per streaming step (each thread's most), likewise.
  double step_sum = 0;
  uint64_t unknown = 0;  // accesses outside every registered buffer (shared memory: ignored)
} rec;

int current_thread() {
  const emu::dim3& t = threadIdx;
  return (int)(t.x + t.y * blockDim.x + t.z * blockDim.x * blockDim.y);
}

int width_index(unsigned w) { return w >= 16 ? 4 : w >= 8 ? 3 : w >= 4 ? 2 : w >= 2 ? 1 : 0; }

}  // namespace

namespace emu {

bool traffic_run_block(uint64_t linear, uint64_t total) {
  return linear < rec.head_blocks || linear + rec.cluster >= total;
}

void traffic_block_begin(int slot, int threads) {
  const emu::dim3& b = blockIdx;
  const uint64_t linear = b.x + (uint64_t)b.y * gridDim.x + (uint64_t)b.z * gridDim.x * gridDim.y;
  if (rec.slots.size() <= (size_t)slot) rec.slots.resize(slot + 1);
  Slot& s = rec.slots[slot];
  s.group = linear < rec.head_blocks ? 0 : 1;
  s.threads.assign(threads, Thread());
  s.instances.clear();
  rec.current = slot;
}

void traffic_block_switch(int slot) { rec.current = slot; }

void traffic_step() {
  Thread& t = rec.slots[rec.current].threads[current_thread()];
  t.max_step_bytes = std::max(t.max_step_bytes, t.step_bytes);
  t.step_bytes = 0;
}

void traffic_sync() {
  traffic_step();
  Thread& t = rec.slots[rec.current].threads[current_thread()];
  t.max_load_bytes = std::max(t.max_load_bytes, t.load_bytes);
  t.load_bytes = 0;
  t.counts.clear();
  ++t.epoch;
}

void traffic_block_end(int slot) {
  Slot& blk = rec.slots[slot];
  for (auto& [key, inst] : blk.instances) {
    std::vector<uint64_t>& s = inst.sectors;
    std::sort(s.begin(), s.end());
    const uint64_t distinct = (uint64_t)(std::unique(s.begin(), s.end()) - s.begin());
    std::vector<uint64_t>& a = inst.addresses;
    std::sort(a.begin(), a.end());
    const uint64_t lanes = (uint64_t)(std::unique(a.begin(), a.end()) - a.begin());
    Dir& d = rec.buffers[key.buffer].group[blk.group][key.store];
    d.requested += inst.bytes;
    d.useful += lanes * inst.width;
    d.instructions += 1;
    d.sectors += distinct;
    d.widths[width_index(inst.width)] += 1;
  }
  blk.instances.clear();
  uint64_t block_bytes = 0;
  uint64_t step_bytes = 0;
  for (Thread& t : blk.threads) {
    block_bytes += std::max(t.max_load_bytes, t.load_bytes);
    step_bytes += std::max(t.max_step_bytes, t.step_bytes);
  }
  if (blk.group == 0 || rec.head_blocks == 0) {
    rec.inflight_sum += (double)block_bytes;
    rec.step_sum += (double)step_bytes;
    ++rec.inflight_blocks;
  }
}

void traffic_access(const void* p, unsigned bytes, unsigned width, bool store, int line) {
  const uintptr_t a = (uintptr_t)p;
  int buffer = -1;
  for (size_t i = 0; i < rec.buffers.size(); ++i)
    if (a >= rec.buffers[i].lo && a < rec.buffers[i].hi) buffer = (int)i;
  if (buffer < 0) {
    ++rec.unknown;
    return;
  }
  Buffer& buf = rec.buffers[buffer];
  if (a + bytes > buf.hi) fail("traffic: an access past the end of its buffer", line);
  const int tid = current_thread();
  Slot& blk = rec.slots[rec.current];
  Thread& t = blk.threads[tid];
  if (!store && !buf.broadcast && !buf.l2) t.load_bytes += bytes;
  if (!store && buf.row) t.step_bytes += bytes;
  for (unsigned off = 0; off < bytes; off += width) {
    const uint64_t ckey = ((uint64_t)line << 20) | ((uint64_t)buffer << 1) | (store ? 1 : 0);
    const int count = t.counts[ckey]++;
    Instance& inst = blk.instances[Key{tid / 32, t.epoch, line, buffer, store ? 1 : 0, count}];
    const uint64_t first = (a + off - buf.lo) / 32, last = (a + off + width - 1 - buf.lo) / 32;
    for (uint64_t s = first; s <= last; ++s) {
      inst.sectors.push_back(s);
      uint8_t& seen = buf.seen[store ? 1 : 0][s];
      if (!seen) {
        seen = 1;
        buf.group[blk.group][store ? 1 : 0].unique += 32;
      }
    }
    inst.addresses.push_back(a + off);
    inst.bytes += width;
    inst.width = width;
  }
}

}  // namespace emu

namespace {

enum Type { F32, F64, BF16, F16 };
const char* kName[] = {"f32", "f64", "bf16", "f16"};
size_t bytes_of(Type t) { return t == F64 ? 8 : t == F32 ? 4 : 2; }
Type acc_of(Type t) { return t == F64 ? F64 : F32; }
size_t wide_bytes_of(Type acc) { return acc == F64 ? 16 : 8; }

uint64_t forward_min_team = 1;  // plan.rs's; 32 reproduces the plans before teams under a warp

// --- plan.rs, re-derived (checked against it: docs/gpu-traffic-plans.txt) -------------------
struct Launch {
  uint64_t grid, block, team, shared, chunk, blocks_per_group, cluster = 1;
};
uint64_t next_pow2(uint64_t v) {
  uint64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}
uint64_t team_size(uint64_t n, uint64_t vec, uint64_t vpt, uint64_t min, uint64_t max) {
  const uint64_t nv = n / vec;
  return std::min(std::max(next_pow2((nv + vpt - 1) / vpt), min), max);
}
uint64_t vec_width(Type x, bool vectorized) { return vectorized ? 16 / bytes_of(x) : 1; }
// plan.rs's backward_vectors_per_thread (the forward's is 4 for both norms).
uint64_t vpt_of(bool backward, Type x, bool vectorized, bool layer = false) {
  if (!backward) return 4;
  if (layer) return vectorized && bytes_of(x) != 4 ? 2 : 4;
  return vectorized && bytes_of(x) == 4 ? 8 : 4;
}
Launch plan_forward(Type x, uint64_t n, uint64_t rows, bool vectorized) {
  const uint64_t team =
      team_size(n, vec_width(x, vectorized), vpt_of(false, x, vectorized), forward_min_team, 1024);
  const uint64_t block = std::max(team, (uint64_t)256);
  const uint64_t teams = block / team;
  const uint64_t grid = std::min(std::max((rows + teams - 1) / teams, (uint64_t)1),
                                 (uint64_t)0x7fffffff);
  return Launch{grid, block, team, 0, 0, 0};
}
uint64_t backward_cluster(Type x, uint64_t n, bool vectorized, uint64_t max_cluster, bool layer) {
  if (!vectorized || layer) return 1;  // LayerNorm's backward has no cluster kernels
  const uint64_t nv = n / vec_width(x, true), cached = 512 * vpt_of(true, x, true);
  if (nv <= cached) return 1;
  for (uint64_t c = 2; c <= std::min(max_cluster, (uint64_t)kMaxCluster); c *= 2)
    if (nv % c == 0 && nv / c <= cached) return c;
  return 1;
}
// `grad_rows`: plan.rs's Sums::rows (0 without a weight, 1 the RMS norm's weight, 2 LayerNorm's
// weight and bias); `layer`: LayerNorm's kernel.
Launch plan_backward(Type x, uint64_t n, uint64_t groups, uint64_t rows_per_group,
                     bool vectorized, uint64_t sm_count, uint64_t grad_rows, uint64_t max_cluster,
                     bool layer = false) {
  const uint64_t vec = vec_width(x, vectorized), block = 512;
  const uint64_t vpt = vpt_of(true, x, vectorized, layer);
  const uint64_t wide = wide_bytes_of(acc_of(x));
  const uint64_t rows_of_grads = std::max(grad_rows, (uint64_t)1);
  const uint64_t cluster = backward_cluster(
      x, n, vectorized, std::min(max_cluster, std::max(sm_count, (uint64_t)1)), layer);
  uint64_t team = team_size(n, vec, vpt, 32, block);
  if (rows_of_grads * n * wide > (32u << 10) || cluster > 1) team = block;
  const uint64_t teams = block / team;
  const bool cached = n / vec <= team * vpt;
  const uint64_t shared = teams > 1 && cached ? rows_of_grads * n * wide : 0;
  groups = std::max(groups, (uint64_t)1);
  const uint64_t wanted = std::max((rows_per_group + teams - 1) / teams, (uint64_t)1);
  uint64_t per_group = (std::max(sm_count / cluster, (uint64_t)1) + groups - 1) / groups;
  if (grad_rows > 0) {
    const uint64_t rows_in_limit =
        (256ull << 20) / (std::max(n, (uint64_t)1) * wide * rows_of_grads);
    per_group = std::max(std::min(per_group, rows_in_limit / groups), (uint64_t)1);
  }
  per_group = std::min(wanted, per_group);
  uint64_t chunk = std::max((rows_per_group + per_group - 1) / per_group, (uint64_t)1);
  // Narrow partials (float32 rows of chunks of at most FOLD_ROWS = 8 rows) where they write no
  // more bytes than the float64 rows.
  if (grad_rows > 0 && teams == 1 && wide == 8 && chunk > 8) {
    const uint64_t narrow_blocks = (rows_per_group + 7) / 8;
    if (narrow_blocks * 4 <= per_group * wide &&
        groups * narrow_blocks * std::max(n, (uint64_t)1) * 4 * rows_of_grads <= (256ull << 20))
      chunk = 8;
  }
  per_group = std::max((rows_per_group + chunk - 1) / chunk, (uint64_t)1);
  return Launch{std::min(groups * per_group * cluster, (uint64_t)0x7fffffff),
                block,
                team,
                shared,
                chunk,
                per_group,
                cluster};
}

// --- buffers and launches -------------------------------------------------------------------
struct Mem {
  void* p = nullptr;
  size_t bytes = 0;
  explicit Mem(size_t b) : bytes(b ? b : 1) {
    // Zero pages, mapped lazily: only the rows of the blocks that run are touched.
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      perror("mmap");
      exit(2);
    }
  }
  ~Mem() { munmap(p, bytes); }
  uint64_t addr() const { return (uint64_t)(uintptr_t)p; }
};

void add_buffer(const char* name, const Mem& m, size_t bytes, bool broadcast) {
  Buffer b;
  b.name = name;
  b.lo = (uintptr_t)m.p;
  b.hi = b.lo + bytes;
  b.broadcast = broadcast;
  const std::string nm = name;
  b.row = nm == "x" || nm == "residual" || nm == "dy" || nm == "dh";
  b.l2 = nm == "dots";
  for (auto& s : b.seen) s.assign(bytes / 32 + 2, 0);
  rec.buffers.push_back(std::move(b));
}

using emu_args::find;
using emu_args::pack;

std::string dir_json(const Dir& d) {
  char s[512];
  snprintf(s, sizeof s,
           "{\"requested\":%llu,\"useful\":%llu,\"instructions\":%llu,\"sectors\":%llu,\"unique\":%llu,"
           "\"widths\":{\"1\":%llu,\"2\":%llu,\"4\":%llu,\"8\":%llu,\"16\":%llu}}",
           (unsigned long long)d.requested, (unsigned long long)d.useful,
           (unsigned long long)d.instructions,
           (unsigned long long)d.sectors, (unsigned long long)d.unique,
           (unsigned long long)d.widths[0], (unsigned long long)d.widths[1],
           (unsigned long long)d.widths[2], (unsigned long long)d.widths[3],
           (unsigned long long)d.widths[4]);
  return s;
}

uint64_t max_blocks = 8;
bool failed = false;

// Runs `kernel` on the recorder's buffers (registered by the caller) and returns its JSON.
std::string run(const std::string& kernel, const Launch& l, emu::Dim block,
                const std::vector<uint64_t>& values, bool cached) {
  const emu::Kernel* k = find(kernel.c_str());
  std::vector<unsigned char> params = pack(k, values);
  // Whole clusters: the first max_blocks blocks' (rounded down to clusters) and the last one.
  const uint64_t c = l.cluster;
  rec.cluster = c;
  rec.head_blocks = std::min(l.grid - c, max_blocks / c * c);
  rec.inflight_sum = 0;
  rec.step_sum = 0;
  rec.inflight_blocks = 0;
  char message[1024];
  if (emu_run_grid(k, emu::Dim{(unsigned)l.grid, 1, 1}, block, (unsigned)c, (unsigned)l.shared,
                   params.data(), 12345, message, sizeof message) != 0) {
    fprintf(stderr, "EMULATOR ERROR in %s: %s\n", kernel.c_str(), message);
    failed = true;
  }
  const double scale = rec.head_blocks ? (double)(l.grid - c) / (double)rec.head_blocks : 0.0;
  std::string bufs;
  for (Buffer& b : rec.buffers) {
    Dir total[2];
    for (int d = 0; d < 2; ++d) {
      total[d].add(b.group[0][d], scale);
      total[d].add(b.group[1][d], 1.0);
      if (b.broadcast) {  // distinct sectors: the blocks read the same ones
        total[d].unique = b.group[0][d].unique + b.group[1][d].unique;
      }
    }
    if (total[0].requested + total[1].requested == 0) continue;
    bufs += std::string(bufs.empty() ? "" : ",") + "{\"name\":\"" + b.name + "\",\"read\":" +
            dir_json(total[0]) + ",\"write\":" + dir_json(total[1]) + "}";
  }
  // Reset for the next launch of the call (the buffers stay registered).
  for (Buffer& b : rec.buffers) {
    for (auto& g : b.group)
      for (auto& d : g) d = Dir();
    for (auto& s : b.seen) std::fill(s.begin(), s.end(), 0);
  }
  char head[1024];
  snprintf(head, sizeof head,
           "{\"kernel\":\"%s\",\"grid\":%llu,\"cluster\":%llu,\"block\":[%u,%u],\"team\":%llu,\"shared\":%llu,"
           "\"chunk\":%llu,\"blocks_per_group\":%llu,\"emulated_blocks\":%llu,\"cached\":%s,"
           "\"load_bytes_per_block_per_sync\":%.1f,\"row_load_bytes_per_block_per_step\":%.1f,"
           "\"buffers\":[",
           kernel.c_str(), (unsigned long long)l.grid, (unsigned long long)c, block.x, block.y,
           (unsigned long long)l.team, (unsigned long long)l.shared, (unsigned long long)l.chunk,
           (unsigned long long)l.blocks_per_group,
           (unsigned long long)(rec.head_blocks + (l.grid > rec.head_blocks ? c : 0)),
           cached ? "true" : "false",
           rec.inflight_blocks ? rec.inflight_sum / (double)rec.inflight_blocks : 0.0,
           rec.inflight_blocks ? rec.step_sum / (double)rec.inflight_blocks : 0.0);
  return std::string(head) + bufs + "]}";
}

uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

void call(const std::string& kind, Type xt, uint64_t n, uint64_t rows) {
  const size_t xb = bytes_of(xt), ab = bytes_of(acc_of(xt));
  const size_t count = rows * n;
  const bool vec = n % (16 / xb) == 0;
  const std::string sfx = std::string(kName[xt]) + "_w" + kName[xt] + (vec ? "_v" : "_s");
  rec.buffers.clear();
  std::vector<std::string> launches;
  char plan[512];
  if (kind == "fwd" || kind == "res" || kind == "lnf" || kind == "lnres") {
    const bool res = kind == "res" || kind == "lnres", layer = kind[0] == 'l';
    const Launch l = plan_forward(xt, n, rows, vec);
    Mem x(count * xb), r(res ? count * xb : 0), w(n * xb), b(layer ? n * xb : 0), y(count * xb),
        h(res ? count * xb : 0), mean(layer ? rows * ab : 0), rstd(rows * ab);
    add_buffer("x", x, count * xb, false);
    if (res) add_buffer("residual", r, count * xb, false);
    add_buffer("w", w, n * xb, true);
    if (layer) add_buffer("b", b, n * xb, true);
    add_buffer("y", y, count * xb, false);
    if (res) add_buffer("h", h, count * xb, false);
    if (layer) add_buffer("mean", mean, rows * ab, false);
    add_buffer("rstd", rstd, rows * ab, false);
    const bool cached = n / vec_width(xt, vec) <= l.team * vpt_of(false, xt, vec);
    const emu::Dim block{(unsigned)l.block, 1, 1};
    const std::vector<uint64_t> tail = {rows, n, l.team, f2u(1e-5f), f2u(-0.0f), rows};
    std::vector<uint64_t> values = {x.addr()};
    if (res) values.push_back(r.addr());
    values.push_back(w.addr());
    if (layer) values.push_back(b.addr());
    values.push_back(y.addr());
    if (res) values.push_back(h.addr());
    if (layer) values.push_back(mean.addr());
    values.push_back(rstd.addr());
    values.insert(values.end(), tail.begin(), tail.end());
    const std::string entry = std::string(layer ? "layernorm" : "rmsnorm") +
                              (res ? "_residual_fwd_" : "_fwd_") + sfx;
    launches.push_back(run(entry, l, block, values, cached));
    snprintf(plan, sizeof plan, "%s %s %s n=%llu rows=%llu grid=%llu block=%llu team=%llu",
             kind.c_str(), kName[xt], vec ? "v" : "s", (unsigned long long)n,
             (unsigned long long)rows, (unsigned long long)l.grid, (unsigned long long)l.block,
             (unsigned long long)l.team);
  } else {
    const bool with_dh = kind == "bwdh", layer = kind == "lnb";
    const uint64_t grad_rows = layer ? 2 : 1;
    const Launch l = plan_backward(xt, n, 1, rows, vec, kSms, grad_rows, kMaxCluster, layer);
    // plan.rs's narrow_partials: float32 partial rows, one per cluster (or block).
    const bool narrow = acc_of(xt) == F32 && l.team == l.block && l.chunk <= 8;
    const size_t wide = narrow ? 4 : wide_bytes_of(acc_of(xt));
    const uint64_t units = l.grid / l.cluster;
    const size_t dots_bytes = l.cluster > 1 ? l.grid * 2 * wide_bytes_of(acc_of(xt)) : 0;
    Mem x(count * xb), w(n * xb), mean(layer ? rows * ab : 0), rstd(rows * ab), dy(count * xb),
        dh(with_dh ? count * xb : 0), dx(count * xb), partial(units * n * wide),
        partial_b(layer ? units * n * wide : 0), dw(n * xb), db(layer ? n * xb : 0),
        dots(dots_bytes);
    add_buffer("x", x, count * xb, false);
    add_buffer("w", w, n * xb, true);
    if (layer) add_buffer("mean", mean, rows * ab, false);
    add_buffer("rstd", rstd, rows * ab, false);
    add_buffer("dy", dy, count * xb, false);
    if (with_dh) add_buffer("dh", dh, count * xb, false);
    add_buffer("dx", dx, count * xb, false);
    add_buffer("partial", partial, units * n * wide, false);
    if (layer) add_buffer("partial_b", partial_b, units * n * wide, false);
    add_buffer("dw", dw, n * xb, false);
    if (layer) add_buffer("db", db, n * xb, false);
    if (dots_bytes) add_buffer("dots", dots, dots_bytes, false);
    const bool cached =
        n / vec_width(xt, vec) / l.cluster <= l.team * vpt_of(true, xt, vec, layer);
    const std::string bwd_sfx =
        l.cluster > 1 ? std::string(kName[xt]) + "_w" + kName[xt] + "_c" : sfx;
    const emu::Dim block{(unsigned)l.block, 1, 1};
    const uint64_t offset = f2u(with_dh ? 1.0f : -0.0f);
    if (layer)
      launches.push_back(run("layernorm_bwd_" + sfx, l, block,
                             {x.addr(), w.addr(), mean.addr(), rstd.addr(), dy.addr(), 0,
                              dx.addr(), partial.addr(), partial_b.addr(), n, l.team, offset,
                              (uint64_t)l.chunk, rows, l.blocks_per_group},
                             cached));
    else
      launches.push_back(run("rmsnorm_bwd_" + bwd_sfx, l, block,
                             {x.addr(), w.addr(), rstd.addr(), dy.addr(), with_dh ? dh.addr() : 0,
                              dx.addr(), partial.addr(), dots_bytes ? dots.addr() : 0, n, l.team,
                              offset, (uint64_t)l.chunk, rows, l.blocks_per_group},
                             cached));
    // The finalize of each gradient: dweight's, and LayerNorm's dbias from its partial rows.
    const Launch f{(n + 31) / 32, 256, 0, 0, 0, 0};
    const std::string finalize =
        std::string("rmsnorm_bwd_finalize_") + kName[acc_of(xt)] + "_w" + kName[xt];
    launches.push_back(run(finalize, f, emu::Dim{32, 8, 1},
                           {partial.addr(), l.blocks_per_group, n, (uint64_t)narrow, dw.addr()},
                           false));
    if (layer)
      launches.push_back(run(finalize, f, emu::Dim{32, 8, 1},
                             {partial_b.addr(), l.blocks_per_group, n, (uint64_t)narrow, db.addr()},
                             false));
    snprintf(plan, sizeof plan,
             "%s %s %s n=%llu rows=%llu sms=%d max_cluster=%d grid=%llu block=%llu team=%llu "
             "shared=%llu chunk=%llu blocks_per_group=%llu cluster=%llu",
             kind.c_str(), kName[xt], vec ? "v" : "s", (unsigned long long)n, (unsigned long long)rows, kSms,
             kMaxCluster, (unsigned long long)l.grid, (unsigned long long)l.block,
             (unsigned long long)l.team, (unsigned long long)l.shared,
             (unsigned long long)l.chunk, (unsigned long long)l.blocks_per_group,
             (unsigned long long)l.cluster);
  }
  std::string all;
  for (auto& s : launches) all += (all.empty() ? "" : ",") + s;
  printf("{\"kind\":\"%s\",\"dtype\":\"%s\",\"n\":%llu,\"rows\":%llu,\"plan\":\"%s\","
         "\"launches\":[%s]}\n",
         kind.c_str(), kName[xt], (unsigned long long)n, (unsigned long long)rows, plan,
         all.c_str());
  fflush(stdout);
  rec.buffers.clear();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) max_blocks = strtoull(argv[1], nullptr, 10);
  if (argc > 2) forward_min_team = strtoull(argv[2], nullptr, 10);
  char kind[16], dtype[16];
  unsigned long long n, rows;
  while (scanf("%15s %15s %llu %llu", kind, dtype, &n, &rows) == 4) {
    Type t = F32;
    bool known = false;
    for (int i = 0; i < 4; ++i)
      if (!strcmp(dtype, kName[i])) t = (Type)i, known = true;
    if (!known || n == 0 || rows == 0) {
      fprintf(stderr, "bad line: %s %s %llu %llu\n", kind, dtype, n, rows);
      return 2;
    }
    call(kind, t, n, rows);
  }
  return failed ? 1 : 0;
}
