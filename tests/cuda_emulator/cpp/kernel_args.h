// The standalone drivers' way to a kernel of the emulated table and its arguments: looked up by
// name, the arguments packed as the kernel's signature lays them out. Shared by harness.cpp
// (`make gpu-sanitize`) and traffic.cpp (`make gpu-traffic`); the Rust side packs them itself.
#pragma once

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "emulator.h"

namespace emu_args {

// The kernel called `name`; exits naming it when the table has none.
inline const emu::Kernel* find(const char* name) {
  int count = 0;
  const emu::Kernel* ks = emu_kernels(&count);
  for (int i = 0; i < count; ++i)
    if (!strcmp(ks[i].name, name)) return &ks[i];
  fprintf(stderr, "no kernel %s\n", name);
  exit(2);
}

// Packs `values` (the low bytes of each, as many as the parameter's size) as the kernel's
// signature lays them out.
inline std::vector<unsigned char> pack(const emu::Kernel* k, const std::vector<uint64_t>& values) {
  if ((int)values.size() != k->param_count) {
    fprintf(stderr, "%s takes %d parameters, got %zu\n", k->name, k->param_count, values.size());
    exit(2);
  }
  std::vector<unsigned char> buf(k->param_bytes);
  unsigned off = 0;
  for (int i = 0; i < k->param_count; ++i) {
    off = (off + k->params[i].align - 1) / k->params[i].align * k->params[i].align;
    memcpy(buf.data() + off, &values[i], k->params[i].size);
    off += k->params[i].size;
  }
  return buf;
}

}  // namespace emu_args
