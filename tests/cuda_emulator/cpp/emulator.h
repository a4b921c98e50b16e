// The emulator's interface between the kernel table (kernels.cpp), the block scheduler
// (fibers.cpp), the fake driver (fake_cuda.cpp) and the sanitizer harness (harness.cpp).
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace emu {

// One kernel parameter as the C++ signature of the entry point has it.
struct Param {
  unsigned size;
  unsigned align;
};

// One `extern "C"` entry point of rmsnorm.cu.
struct Kernel {
  const char* name;
  int max_threads;  // __launch_bounds__'s first argument
  int min_blocks;   // its second (0 when absent)
  int param_count;
  const Param* params;
  unsigned param_bytes;  // the packed parameter buffer: each parameter at its natural alignment
  void (*invoke)(const unsigned char* packed);
};

struct Dim {
  unsigned x, y, z;
};

}  // namespace emu

extern "C" {
// The kernels of this build, from the table build.rs generated from the preprocessed source.
const emu::Kernel* emu_kernels(int* count);
// Runs a whole grid of `kernel` with `params` (packed as Kernel::param_bytes says), blocks in an
// order shuffled by `seed`, in clusters of `cluster` blocks along x (1: none; grid.x must be a
// multiple). Returns 0, or -1 with a message in `message` (the first error).
int emu_run_grid(const emu::Kernel* kernel, emu::Dim grid, emu::Dim block, unsigned cluster,
                 unsigned dynamic_bytes, const unsigned char* params, uint64_t seed,
                 char* message, size_t capacity);
// The kernel source's host half conversions, for the bit-for-bit test against `half`.
float emu_f16_to_f32(unsigned short bits);
unsigned short emu_f32_to_f16(float value);
}
