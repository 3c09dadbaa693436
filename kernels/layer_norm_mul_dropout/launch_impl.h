// Templated launch bodies, included once per dtype by instantiations/*.cu.
#pragma once

#include <algorithm>

#include "bwd_kernel.h"
#include "fwd_kernel.h"
#include "launch.h"
#include "ln_kernel.h"

namespace lnmd {

// Calls fn(Traits<WPR, ITERS>{}) for the layout shape_for(cols) picks.
template <typename Fn>
void dispatch_shape(int cols, Fn&& fn) {
  const Shape s = shape_for(cols);
  if (s.wpr == 1 && s.iters == 1) return fn(Traits<1, 1>{});
  if (s.wpr == 1) return fn(Traits<1, 2>{});
  if (s.wpr == 2) return fn(Traits<2, 2>{});
  if (s.iters == 2) return fn(Traits<4, 2>{});
  if (s.iters == 4) return fn(Traits<4, 4>{});
  return fn(Traits<4, 8>{});
}

inline int smem_bwd(int cols, int rpb) { return (rpb - 1) * 2 * cols * static_cast<int>(sizeof(float)); }

// Resident blocks per SM of `kernel` (queried once per kernel by the callers' statics).
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int smem) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) !=
          cudaSuccess ||
      per_sm < 1) {
    cudaGetLastError();  // clear a failed query; one block per SM still runs correctly
    per_sm = 1;
  }
  return per_sm;
}

inline int grid_for(int per_sm, int64_t rows, int rpb, int num_sms) {
  const int64_t needed = (rows + rpb - 1) / rpb;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(per_sm) * num_sms)));
}

// Backward shared memory of layout Tr at its widest row (the occupancy query's upper bound).
template <typename Tr>
constexpr int max_smem_bwd() {
  return (Tr::RPB - 1) * 2 * (8 * Tr::TPR * Tr::ITERS) * static_cast<int>(sizeof(float));
}

template <typename T>
void run_fwd(const FwdParams& p, int num_sms, cudaStream_t stream) {
  if (p.rows == 0) return;
  dispatch_shape(p.cols, [&](auto tr) {
    using Tr = decltype(tr);
    static const int per_sm = blocks_per_sm(fwd_kernel<T, Tr>, 0);
    fwd_kernel<T, Tr><<<grid_for(per_sm, p.rows, Tr::RPB, num_sms), kThreads, 0, stream>>>(p);
  });
}

template <typename T>
int grid_bwd(int cols, int64_t rows, int num_sms) {
  if (rows == 0) return 0;
  int grid = 0;
  dispatch_shape(cols, [&](auto tr) {
    using Tr = decltype(tr);
    static const int per_sm = blocks_per_sm(bwd_kernel<T, Tr>, max_smem_bwd<Tr>());
    grid = grid_for(per_sm, rows, Tr::RPB, num_sms);
  });
  return grid;
}

template <typename T>
void run_bwd(const BwdParams& p, int grid, cudaStream_t stream) {
  if (p.rows == 0 || grid == 0) return;
  dispatch_shape(p.cols, [&](auto tr) {
    using Tr = decltype(tr);
    bwd_kernel<T, Tr><<<grid, kThreads, smem_bwd(p.cols, Tr::RPB), stream>>>(p);
  });
}

template <typename T>
void run_ln_fwd(const LnFwdParams& p, int num_sms, cudaStream_t stream) {
  if (p.rows == 0) return;
  dispatch_shape(p.cols, [&](auto tr) {
    using Tr = decltype(tr);
    static const int per_sm = blocks_per_sm(ln_fwd_kernel<T, Tr>, 0);
    ln_fwd_kernel<T, Tr><<<grid_for(per_sm, p.rows, Tr::RPB, num_sms), kThreads, 0, stream>>>(p);
  });
}

template <typename T>
int grid_ln_bwd(int cols, int64_t rows, int num_sms) {
  if (rows == 0) return 0;
  int grid = 0;
  dispatch_shape(cols, [&](auto tr) {
    using Tr = decltype(tr);
    static const int per_sm = blocks_per_sm(ln_bwd_kernel<T, Tr>, max_smem_bwd<Tr>());
    grid = grid_for(per_sm, rows, Tr::RPB, num_sms);
  });
  return grid;
}

template <typename T>
void run_ln_bwd(const LnBwdParams& p, int grid, cudaStream_t stream) {
  if (p.rows == 0 || grid == 0) return;
  dispatch_shape(p.cols, [&](auto tr) {
    using Tr = decltype(tr);
    ln_bwd_kernel<T, Tr><<<grid, kThreads, smem_bwd(p.cols, Tr::RPB), stream>>>(p);
  });
}

}  // namespace lnmd
