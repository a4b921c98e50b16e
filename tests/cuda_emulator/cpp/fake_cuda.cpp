// A fake libcuda for the tests: the driver entry points src/handlers/gpu/driver uses, on host
// memory, running kernels on the CPU emulator. Loaded by the product's own library search
// through RMSNORM_FFI_LIBCUDA; NVRTC stays real, so module images are the real cubins/PTX.
//
// What it checks, beyond what the real driver would: every launch against sm_90's limits
// (block and grid dimensions, threads per block within the kernel's __launch_bounds__, the
// 48 KB default of dynamic shared memory: the driver table has no cuFuncSetAttribute to raise
// it), the packed parameter buffer against the kernel's C++ signature (size and layout), that
// the function's module lives in the current context and the stream's, and after every launch
// the guard zones around every allocation (device memory is host memory with 256 bytes of 0xff
// on both sides; fresh memory is 0xff too, NaN in every float type, so reading what was never
// written shows). Stream capture is modelled: a module load or an allocation while a stream of
// the context captures (global mode) fails and invalidates the capture, as the real driver does.
//
// Knobs: RMSNORM_FFI_FAKE_DEVICES (default 2), RMSNORM_FFI_FAKE_SMS (default 4: keeps grids,
// and so the emulation, small), RMSNORM_FFI_FAKE_SEED (block and thread order), and
// RMSNORM_FFI_FAKE_KERNELS (the emulated kernels' library; default: next to this one).
// Test-only entry points (emu_*) allocate guarded buffers, make streams, set capture, swap in
// kernels built from another source, and report counters.
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "emulator.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : CUresult {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_IMAGE = 200,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_FOUND = 500,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
  CUDA_ERROR_LAUNCH_FAILED = 719,
  CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
  CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
};

namespace {

constexpr size_t kGuard = 256;
constexpr int kMaxThreads = 1024;
constexpr unsigned kMaxDynamicShared = 48 * 1024;

struct Context {
  int device;
  int retains = 0;
};
struct Module {
  Context* ctx;
  std::vector<unsigned char> image;
  bool ptx;
};
// A function names its kernel; launches look it up in the kernels in use then, so that a test
// can swap in kernels built from another source under modules already loaded.
struct Function {
  Module* module;
  std::string name;
};
struct Stream {
  Context* ctx;
  int capture = 0;  // 0 none, 1 active, 2 invalidated
};
struct Allocation {
  unsigned char* base;
  size_t bytes;
  size_t front;  // guard bytes (and any misalignment) before the data
  bool driver;   // cuMemAlloc (true) or a test buffer (false)
};

std::recursive_mutex g_mutex;
bool g_init = false;
int g_devices = 2, g_sms = 4;
uint64_t g_seed = 1;
std::vector<Context> g_contexts;
thread_local std::vector<Context*> t_stack;
std::map<uintptr_t, Allocation> g_allocations;  // by data address
std::vector<Stream*> g_streams;
const emu::Kernel* g_kernels = nullptr;
int g_kernel_count = 0;
std::string g_last_error;
long g_launches = 0, g_module_loads = 0, g_guard_failures = 0, g_driver_bytes = 0,
     g_driver_allocations = 0, g_cluster_launches = 0;

int env_int(const char* name, int fallback) {
  const char* v = getenv(name);
  return v && *v ? atoi(v) : fallback;
}

void report(const std::string& message) {
  g_last_error = message;
  fprintf(stderr, "fake libcuda: %s\n", message.c_str());
}

int (*g_run_grid)(const emu::Kernel*, emu::Dim, emu::Dim, unsigned, unsigned,
                  const unsigned char*, uint64_t, char*, size_t) = nullptr;

bool use_kernels(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    report(std::string("cannot load the emulated kernels: ") + dlerror());
    return false;
  }
  auto table = (const emu::Kernel* (*)(int*))dlsym(lib, "emu_kernels");
  auto run = (decltype(g_run_grid))dlsym(lib, "emu_run_grid");
  if (!table || !run) {
    report(std::string(path) + " has no emu_kernels/emu_run_grid");
    return false;
  }
  g_kernels = table(&g_kernel_count);
  g_run_grid = run;
  return true;
}

std::string default_kernels_path() {
  Dl_info info;
  if (!dladdr((void*)&default_kernels_path, &info) || !info.dli_fname) return "";
  std::string self = info.dli_fname;
  const size_t slash = self.rfind('/');
  return (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) +
         "/libemu_kernels.so";
}

Context* current() { return t_stack.empty() ? nullptr : t_stack.back(); }

const emu::Kernel* kernel_named(const char* name) {
  for (int i = 0; i < g_kernel_count; ++i)
    if (!strcmp(g_kernels[i].name, name)) return &g_kernels[i];
  return nullptr;
}

bool capturing(Context* ctx) {
  for (Stream* s : g_streams)
    if (s->ctx == ctx && s->capture == 1) return true;
  return false;
}

// A call the real driver refuses during a global-mode capture: fails it and invalidates the
// capture.
bool refuse_under_capture(Context* ctx, const char* call) {
  if (!capturing(ctx)) return false;
  for (Stream* s : g_streams)
    if (s->ctx == ctx && s->capture == 1) s->capture = 2;
  report(std::string(call) + " while a stream of the context is capturing: capture invalidated");
  return true;
}

unsigned char* guarded(size_t bytes, size_t misalign, bool driver) {
  const size_t front = kGuard + misalign;
  unsigned char* base = (unsigned char*)malloc(front + bytes + kGuard);
  if (!base) return nullptr;
  memset(base, 0xff, front + bytes + kGuard);
  unsigned char* data = base + front;
  g_allocations[(uintptr_t)data] = Allocation{base, bytes, front, driver};
  if (driver) {
    g_driver_bytes += (long)bytes;
    ++g_driver_allocations;
  }
  return data;
}

int check_guards(const char* after) {
  int bad = 0;
  for (auto& [data, a] : g_allocations) {
    for (size_t i = 0; i < a.front; ++i)
      if (a.base[i] != 0xff) {
        report(std::string("write before the start of a ") + std::to_string(a.bytes) +
               "-byte buffer, " + std::to_string(a.front - i) + " bytes before it, after " + after);
        ++bad;
        break;
      }
    for (size_t i = 0; i < kGuard; ++i)
      if (a.base[a.front + a.bytes + i] != 0xff) {
        report(std::string("write past the end of a ") + std::to_string(a.bytes) +
               "-byte buffer (byte " + std::to_string(i) + " after it), after " + after);
        ++bad;
        break;
      }
  }
  g_guard_failures += bad;
  return bad;
}

// Finds `name` as an entry of the image: `.entry name(` in PTX, a NUL-delimited symbol in a
// cubin's string table.
bool image_has(const Module& m, const std::string& name) {
  const std::string needle = m.ptx ? ".entry " + name + "(" : std::string(1, '\0') + name + '\0';
  return std::search(m.image.begin(), m.image.end(), needle.begin(), needle.end()) !=
         m.image.end();
}

}  // namespace

extern "C" {

CUresult cuInit(unsigned flags) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (g_init) return CUDA_SUCCESS;
  g_devices = env_int("RMSNORM_FFI_FAKE_DEVICES", 2);
  g_sms = env_int("RMSNORM_FFI_FAKE_SMS", 4);
  g_seed = (uint64_t)env_int("RMSNORM_FFI_FAKE_SEED", 1);
  g_contexts.resize(g_devices);
  for (int i = 0; i < g_devices; ++i) g_contexts[i] = Context{i, 0};
  const char* path = getenv("RMSNORM_FFI_FAKE_KERNELS");
  const std::string fallback = default_kernels_path();
  if (!use_kernels(path && *path ? path : fallback.c_str())) return CUDA_ERROR_NOT_INITIALIZED;
  g_init = true;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** name) {
  static const std::map<int, const char*> names = {
      {0, "CUDA_SUCCESS"}, {1, "CUDA_ERROR_INVALID_VALUE"}, {2, "CUDA_ERROR_OUT_OF_MEMORY"},
      {3, "CUDA_ERROR_NOT_INITIALIZED"}, {101, "CUDA_ERROR_INVALID_DEVICE"},
      {200, "CUDA_ERROR_INVALID_IMAGE"}, {201, "CUDA_ERROR_INVALID_CONTEXT"},
      {400, "CUDA_ERROR_INVALID_HANDLE"}, {500, "CUDA_ERROR_NOT_FOUND"},
      {700, "CUDA_ERROR_ILLEGAL_ADDRESS"}, {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"},
      {719, "CUDA_ERROR_LAUNCH_FAILED"}, {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"},
      {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"}};
  auto it = names.find(error);
  if (it == names.end()) return CUDA_ERROR_INVALID_VALUE;
  *name = it->second;
  return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* version) {
  *version = 12080;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* count) {
  if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
  *count = g_devices;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  if (!g_init) return CUDA_ERROR_NOT_INITIALIZED;
  if (ordinal < 0 || ordinal >= g_devices) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice device) {
  if (device < 0 || device >= g_devices) return CUDA_ERROR_INVALID_DEVICE;
  switch (attribute) {
    case 1: *value = kMaxThreads; break;                  // MAX_THREADS_PER_BLOCK
    case 2: case 3: *value = 1024; break;                 // MAX_BLOCK_DIM_X/Y
    case 4: *value = 64; break;                           // MAX_BLOCK_DIM_Z
    case 5: *value = 2147483647; break;                   // MAX_GRID_DIM_X
    case 6: case 7: *value = 65535; break;                // MAX_GRID_DIM_Y/Z
    case 8: *value = (int)kMaxDynamicShared; break;       // MAX_SHARED_MEMORY_PER_BLOCK
    case 10: *value = 32; break;                          // WARP_SIZE
    case 16: *value = g_sms; break;                       // MULTIPROCESSOR_COUNT
    case 38: *value = 50 * 1024 * 1024; break;            // L2_CACHE_SIZE
    case 75: *value = 9; break;                           // COMPUTE_CAPABILITY_MAJOR
    case 76: *value = 0; break;                           // COMPUTE_CAPABILITY_MINOR
    case 97: *value = 227 * 1024; break;                  // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    default: return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice device) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (device < 0 || device >= g_devices) return CUDA_ERROR_INVALID_DEVICE;
  ++g_contexts[device].retains;
  *ctx = &g_contexts[device];
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (device < 0 || device >= g_devices || g_contexts[device].retains == 0)
    return CUDA_ERROR_INVALID_CONTEXT;
  --g_contexts[device].retains;
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(void** ctx) {
  *ctx = current();
  return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(void* ctx) {
  if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
  t_stack.push_back((Context*)ctx);
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (t_stack.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx) *ctx = t_stack.back();
  t_stack.pop_back();
  return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* device) {
  Context* ctx = current();
  if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
  *device = ctx->device;
  return CUDA_SUCCESS;
}

CUresult cuStreamGetCtx(void* stream, void** ctx) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (!stream) {  // the legacy default stream belongs to the current context
    if (!current()) return CUDA_ERROR_INVALID_CONTEXT;
    *ctx = current();
    return CUDA_SUCCESS;
  }
  if (std::find(g_streams.begin(), g_streams.end(), (Stream*)stream) == g_streams.end())
    return CUDA_ERROR_INVALID_HANDLE;
  *ctx = ((Stream*)stream)->ctx;
  return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(void* stream, int* status) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (!stream) {
    *status = 0;
    return CUDA_SUCCESS;
  }
  if (std::find(g_streams.begin(), g_streams.end(), (Stream*)stream) == g_streams.end())
    return CUDA_ERROR_INVALID_HANDLE;
  *status = ((Stream*)stream)->capture;
  return CUDA_SUCCESS;
}

CUresult cuModuleLoadData(void** module, const void* image) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  Context* ctx = current();
  if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
  if (refuse_under_capture(ctx, "cuModuleLoadData")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  const unsigned char* p = (const unsigned char*)image;
  Module* m = new Module{ctx, {}, false};
  if (p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F') {
    // A cubin: ELF64, section headers at e_shoff, e_shentsize * e_shnum bytes of them.
    uint64_t shoff;
    uint16_t shentsize, shnum;
    memcpy(&shoff, p + 0x28, 8);
    memcpy(&shentsize, p + 0x3a, 2);
    memcpy(&shnum, p + 0x3c, 2);
    m->image.assign(p, p + shoff + (size_t)shentsize * shnum);
  } else {
    const size_t len = strlen((const char*)p);
    if (len == 0 || !strstr((const char*)p, ".entry")) {
      delete m;
      return CUDA_ERROR_INVALID_IMAGE;
    }
    m->image.assign(p, p + len);
    m->ptx = true;
  }
  ++g_module_loads;
  *module = m;
  return CUDA_SUCCESS;
}

CUresult cuModuleUnload(void* module) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  delete (Module*)module;
  return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(void** function, void* module, const char* name) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  Module* m = (Module*)module;
  if (!image_has(*m, name)) return CUDA_ERROR_NOT_FOUND;
  if (kernel_named(name)) {
    *function = new Function{m, name};
    return CUDA_SUCCESS;
  }
  report(std::string("the module has `") + name + "` but the emulator has no such kernel");
  return CUDA_ERROR_NOT_FOUND;
}

CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  Context* ctx = current();
  if (!ctx) return CUDA_ERROR_INVALID_CONTEXT;
  if (refuse_under_capture(ctx, "cuMemAlloc")) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  unsigned char* data = guarded(bytes, 0, true);
  if (!data) return CUDA_ERROR_OUT_OF_MEMORY;
  *ptr = (CUdeviceptr)(uintptr_t)data;
  return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  auto it = g_allocations.find((uintptr_t)ptr);
  if (it == g_allocations.end() || !it->second.driver) return CUDA_ERROR_INVALID_VALUE;
  check_guards("cuMemFree");
  g_driver_bytes -= (long)it->second.bytes;
  free(it->second.base);
  g_allocations.erase(it);
  return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, void* function, int block_size,
                                                     size_t dynamic_bytes) {
  const Function* f = (const Function*)function;
  const emu::Kernel* k = kernel_named(f->name.c_str());
  if (!k) return CUDA_ERROR_NOT_FOUND;
  if (block_size <= 0 || block_size > k->max_threads) {
    *blocks = 0;
    return CUDA_SUCCESS;
  }
  int by_threads = 2048 / block_size;
  int by_smem = dynamic_bytes ? (int)((228 * 1024) / (dynamic_bytes + 1024)) : 32;
  *blocks = std::min(std::min(by_threads, by_smem), 32);
  return CUDA_SUCCESS;
}

// cuLaunchKernel and cuLaunchKernelEx: `cluster` blocks per cluster along x (1: none).
CUresult launch(const char* api, void* function, unsigned gx, unsigned gy, unsigned gz,
                unsigned bx, unsigned by, unsigned bz, unsigned cluster, unsigned shared,
                void* stream, void** params, void** extra) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  const Function* f = (const Function*)function;
  const emu::Kernel* k = kernel_named(f->name.c_str());
  Context* ctx = current();
  auto refuse = [&](CUresult code, const std::string& why) {
    report(std::string(api) + "(" + f->name + "): " + why);
    return code;
  };
  if (!k) return refuse(CUDA_ERROR_NOT_FOUND, "the kernels in use have no such kernel");
  if (!ctx) return refuse(CUDA_ERROR_INVALID_CONTEXT, "no current context");
  if (f->module->ctx != ctx)
    return refuse(CUDA_ERROR_INVALID_HANDLE, "the function's module belongs to another context");
  Stream* s = (Stream*)stream;
  if (s) {
    if (std::find(g_streams.begin(), g_streams.end(), s) == g_streams.end())
      return refuse(CUDA_ERROR_INVALID_HANDLE, "unknown stream");
    if (s->ctx != ctx) return refuse(CUDA_ERROR_INVALID_HANDLE, "the stream is another context's");
    if (s->capture == 2) return refuse(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "capture invalidated");
  }
  if (!gx || !gy || !gz || !bx || !by || !bz) return refuse(CUDA_ERROR_INVALID_VALUE, "a zero dimension");
  if (bx > 1024 || by > 1024 || bz > 64 || (unsigned long)bx * by * bz > kMaxThreads)
    return refuse(CUDA_ERROR_INVALID_VALUE, "block (" + std::to_string(bx) + "," +
                                                std::to_string(by) + "," + std::to_string(bz) +
                                                ") exceeds sm_90's limits");
  if ((long)bx * by * bz > k->max_threads)
    return refuse(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
                  std::to_string(bx * by * bz) + " threads per block, over __launch_bounds__(" +
                      std::to_string(k->max_threads) + ")");
  if (gx > 2147483647u || gy > 65535 || gz > 65535)
    return refuse(CUDA_ERROR_INVALID_VALUE, "grid exceeds sm_90's limits");
  // Clusters: at most 8 blocks (the portable size, without cuFuncSetAttribute's
  // NON_PORTABLE_CLUSTER_SIZE_ALLOWED), a divisor of the grid, on as many SMs as blocks.
  if (cluster == 0 || cluster > 8 || gx % cluster != 0)
    return refuse(CUDA_ERROR_INVALID_VALUE, "a cluster of " + std::to_string(cluster) +
                                                " blocks in a grid of " + std::to_string(gx));
  if (cluster > (unsigned)g_sms)
    return refuse(CUDA_ERROR_INVALID_VALUE, "a cluster of " + std::to_string(cluster) +
                                                " blocks on " + std::to_string(g_sms) + " SMs");
  if (shared > kMaxDynamicShared)
    return refuse(CUDA_ERROR_INVALID_VALUE,
                  std::to_string(shared) + " bytes of dynamic shared memory, over the 48 KB "
                                           "default");
  std::vector<unsigned char> packed(k->param_bytes);
  if (extra) {
    if (params) return refuse(CUDA_ERROR_INVALID_VALUE, "both kernelParams and extra");
    const void* buffer = nullptr;
    size_t size = (size_t)-1;
    for (int i = 0; extra[i] != (void*)0; i += 2) {
      if (extra[i] == (void*)1) buffer = extra[i + 1];
      else if (extra[i] == (void*)2) size = *(const size_t*)extra[i + 1];
      else return refuse(CUDA_ERROR_INVALID_VALUE, "unknown entry in extra");
    }
    if (!buffer || size != k->param_bytes)
      return refuse(CUDA_ERROR_INVALID_VALUE,
                    "a parameter buffer of " + std::to_string(size) + " bytes; the kernel's " +
                        std::to_string(k->param_count) + " parameters take " +
                        std::to_string(k->param_bytes));
    memcpy(packed.data(), buffer, k->param_bytes);
  } else {
    if (!params) return refuse(CUDA_ERROR_INVALID_VALUE, "no parameters");
    unsigned off = 0;
    for (int i = 0; i < k->param_count; ++i) {
      off = (off + k->params[i].align - 1) / k->params[i].align * k->params[i].align;
      memcpy(packed.data() + off, params[i], k->params[i].size);
      off += k->params[i].size;
    }
  }
  ++g_launches;
  char message[1024] = {0};
  if (cluster > 1) ++g_cluster_launches;
  const int rc = g_run_grid(k, emu::Dim{gx, gy, gz}, emu::Dim{bx, by, bz}, cluster, shared,
                            packed.data(), g_seed * 1000003u + (uint64_t)g_launches, message,
                            sizeof message);
  const int bad = check_guards(("a launch of " + f->name).c_str());
  if (rc != 0) return refuse(CUDA_ERROR_LAUNCH_FAILED, message);
  if (bad) return CUDA_ERROR_ILLEGAL_ADDRESS;
  return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void* stream, void** params,
                        void** extra) {
  return launch("cuLaunchKernel", function, gx, gy, gz, bx, by, bz, 1, shared, stream, params,
                extra);
}

// cuda.h's CUlaunchConfig and CUlaunchAttribute (CUDA 12.0 and later).
struct alignas(8) CUlaunchAttribute {  // its value union holds pointers
  int id;  // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
  char pad[4];
  union {
    char bytes[64];
    struct {
      unsigned x, y, z;
    } cluster_dim;
  } value;
};
struct CUlaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
  void* stream;
  CUlaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(CUlaunchAttribute) == 72, "cuda.h's CUlaunchAttribute");
static_assert(sizeof(CUlaunchConfig) == 56, "cuda.h's CUlaunchConfig");

// Only the cluster dimension is known (along x: y and z must be 1); any other attribute fails.
CUresult cuLaunchKernelEx(const CUlaunchConfig* config, void* function, void** params,
                          void** extra) {
  if (!config) return CUDA_ERROR_INVALID_VALUE;
  unsigned cluster = 1;
  for (unsigned i = 0; i < config->num_attrs; ++i) {
    const CUlaunchAttribute& a = config->attrs[i];
    if (a.id == 0) continue;  // CU_LAUNCH_ATTRIBUTE_IGNORE
    if (a.id != 4 || a.value.cluster_dim.y != 1 || a.value.cluster_dim.z != 1) {
      report("cuLaunchKernelEx: attribute " + std::to_string(a.id) + " is not modelled");
      return CUDA_ERROR_INVALID_VALUE;
    }
    cluster = a.value.cluster_dim.x;
  }
  return launch("cuLaunchKernelEx", function, config->grid_x, config->grid_y, config->grid_z,
                config->block_x, config->block_y, config->block_z, cluster, config->shared,
                config->stream, params, extra);
}

// ----------------------------------------------------------------------------------------------
// Test-only entry points
// ----------------------------------------------------------------------------------------------

// A guarded buffer of `bytes` whose data starts `misalign` bytes past a 256-byte boundary.
void* emu_alloc(size_t bytes, size_t misalign) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  return guarded(bytes, misalign, false);
}

int emu_free(void* data) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  auto it = g_allocations.find((uintptr_t)data);
  if (it == g_allocations.end() || it->second.driver) return -1;
  const int bad = check_guards("a test buffer's release");
  free(it->second.base);
  g_allocations.erase(it);
  return bad;
}

void* emu_stream_create(int device) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (device < 0 || device >= (int)g_contexts.size()) return nullptr;
  Stream* s = new Stream{&g_contexts[device], 0};
  g_streams.push_back(s);
  return s;
}

int emu_stream_set_capture(void* stream, int status) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  auto it = std::find(g_streams.begin(), g_streams.end(), (Stream*)stream);
  if (it == g_streams.end()) return -1;
  (*it)->capture = status;
  return 0;
}

int emu_use_kernels(const char* path) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  if (!g_init && cuInit(0) != CUDA_SUCCESS) return -1;
  return use_kernels(path) ? 0 : -1;
}

// Counters: launches, module loads, guard failures, driver bytes held, driver allocations made,
// test buffers and driver allocations outstanding, primary-context retains, cluster launches.
void emu_counters(long* out, int count) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  long retains = 0;
  for (auto& c : g_contexts) retains += c.retains;
  const long values[] = {g_launches, g_module_loads, g_guard_failures, g_driver_bytes,
                         g_driver_allocations, (long)g_allocations.size(), retains,
                         g_cluster_launches};
  for (int i = 0; i < count && i < (int)(sizeof values / sizeof values[0]); ++i) out[i] = values[i];
}

// The last error reported, copied into `out`; returns its length.
size_t emu_last_error(char* out, size_t capacity) {
  std::lock_guard<std::recursive_mutex> lock(g_mutex);
  snprintf(out, capacity, "%s", g_last_error.c_str());
  return g_last_error.size();
}

}  // extern "C"
