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

// Which bias a launcher serves: none, any (position and/or time), or the position term alone
// (a backward without the time term's code: fewer registers, so fewer spills; used when the call
// has no time weight and the build has it, else kAny serves).
enum class BiasKind : int { kNone = 0, kAny = 1, kPosition = 2 };
constexpr int kBiasKinds = 3;
// The kernel template's kBias and kTime flags of a kind.
constexpr bool bias_kind_has_bias(BiasKind k) { return k != BiasKind::kNone; }
constexpr bool bias_kind_has_time(BiasKind k) { return k == BiasKind::kAny; }

// Slot of (direction, bias kind, dtype, head dim index) in the table of 2 x 3 x 2 x 4 launchers.
constexpr int kLauncherSlots = 2 * kBiasKinds * 2 * 4;
inline int launcher_slot(Direction dir, BiasKind kind, DType dt, int i) {
  return ((int(dir) * kBiasKinds + int(kind)) * 2 + int(dt)) * 4 + i;
}

inline bool register_launcher(Direction dir, DType dt, int d, BiasKind kind, Launcher fn) {
  launcher_table()[launcher_slot(dir, kind, dt, head_dim_index(d))] = fn;
  return true;
}

inline Launcher find_launcher(Direction dir, DType dt, int d, BiasKind kind) {
  const int i = head_dim_index(d);
  return i < 0 ? nullptr : launcher_table()[launcher_slot(dir, kind, dt, i)];
}

}  // namespace hstu
