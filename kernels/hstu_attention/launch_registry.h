// Table of the compiled launchers, filled by the instantiation files at load time.
// Plain C++ + CUDA runtime: included by api.cpp (host compiler) and by the kernels (nvcc).
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace hstu {

enum class Direction : int { kFwd = 0, kBwd = 1 };
using Launcher = cudaError_t (*)(HstuParams&, cudaStream_t);

inline int head_dim_index(int d) {
  switch (d) {
    case 32: return 0;
    case 64: return 1;
    case 128: return 2;
    case 256: return 3;
    default: return -1;
  }
}

// Defined in registry.cpp (a single table for the whole extension).
Launcher* launcher_table();

// Slot of (direction, bias, dtype, head dim index) in the table of 2 x 2 x 2 x 4 launchers.
inline int launcher_slot(Direction dir, bool bias, DType dt, int i) {
  return ((int(dir) * 2 + int(bias)) * 2 + int(dt)) * 4 + i;
}

inline bool register_launcher(Direction dir, DType dt, int d, bool bias, Launcher fn) {
  launcher_table()[launcher_slot(dir, bias, dt, head_dim_index(d))] = fn;
  return true;
}

inline Launcher find_launcher(Direction dir, DType dt, int d, bool bias) {
  const int i = head_dim_index(d);
  return i < 0 ? nullptr : launcher_table()[launcher_slot(dir, bias, dt, i)];
}

}  // namespace hstu
