// rmsnorm.cu compiled as host C++ (cuda_shim.h is force-included), and its kernel table.
//
// EMU_KERNEL_SOURCE is the path of the kernel source (the real one, or a copy with a planted
// bug); EMU_KERNEL_TABLE the list build.rs made of its entry points with their launch bounds.
#include <string.h>

#include <tuple>
#include <utility>

#include "emulator.h"

#include EMU_KERNEL_SOURCE

namespace emu {

constexpr unsigned align_up(unsigned offset, unsigned align) {
  return (offset + align - 1) / align * align;
}

template <typename Fn, Fn F>
struct Adapter;

// Unpacks a parameter buffer by the entry point's own C++ signature.
template <typename... P, void (*F)(P...)>
struct Adapter<void (*)(P...), F> {
  static constexpr Param params[sizeof...(P) > 0 ? sizeof...(P) : 1] = {
      Param{(unsigned)sizeof(P), (unsigned)alignof(P)}...};

  static constexpr unsigned bytes() {
    unsigned offset = 0;
    ((offset = align_up(offset, alignof(P)) + sizeof(P)), ...);
    return offset;
  }

  template <size_t... I>
  static void call(const unsigned char* packed, std::index_sequence<I...>) {
    std::tuple<P...> args;
    unsigned offset = 0;
    ((offset = align_up(offset, alignof(P)),
      memcpy(&std::get<I>(args), packed + offset, sizeof(P)), offset += sizeof(P)),
     ...);
    std::apply(F, args);
  }

  static void invoke(const unsigned char* packed) {
    call(packed, std::index_sequence_for<P...>{});
  }

  static Kernel kernel(const char* name, int max_threads, int min_blocks) {
    return Kernel{name, max_threads, min_blocks, (int)sizeof...(P), params, bytes(), &invoke};
  }
};

}  // namespace emu

#define EMU_KERNEL(name, max_threads, min_blocks) \
  ::emu::Adapter<decltype(&name), &name>::kernel(#name, max_threads, min_blocks),

static const emu::Kernel kKernels[] = {
#include EMU_KERNEL_TABLE
};

extern "C" const emu::Kernel* emu_kernels(int* count) {
  *count = (int)(sizeof(kKernels) / sizeof(kKernels[0]));
  return kKernels;
}

extern "C" float emu_f16_to_f32(unsigned short bits) {
  f16_t h;
  h.bits = bits;
  return Elem<f16_t>::load(h);
}

extern "C" unsigned short emu_f32_to_f16(float value) { return Elem<f16_t>::store(value).bits; }
