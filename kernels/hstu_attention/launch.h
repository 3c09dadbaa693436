// Grid, shared-memory size and tile configuration per (dtype, head dim); the instantiation files
// include this and instantiate run_hstu_fwd / run_hstu_bwd for one pair each.
#pragma once

#include <cuda_runtime.h>

#include "bwd_kernel.h"
#include "fwd_kernel.h"
#include "kernel_traits.h"
#include "launch_registry.h"
#include "params.h"

namespace hstu {

// Forward tiles (kBlockM, kBlockN, warps): register budget of the fp32 S and O fragments.
template <typename T, int D>
struct FwdConfig;
template <typename T>
struct FwdConfig<T, 32> {
  using type = FwdTraits<T, 32, 128, 128, 4>;
};
template <typename T>
struct FwdConfig<T, 64> {
  using type = FwdTraits<T, 64, 128, 128, 4>;
};
template <typename T>
struct FwdConfig<T, 128> {
  using type = FwdTraits<T, 128, 128, 64, 4>;
};
template <typename T>
struct FwdConfig<T, 256> {
  using type = FwdTraits<T, 256, 128, 64, 8>;
};

// Backward tiles (kBlockM, kBlockN, warps, warp layouts of S/dP, dK/dV, dQ, double-buffered
// Q/dO); every configuration fits the A100's 163 KB of shared memory per block.
template <typename T, int D>
struct BwdConfig;
template <typename T>
struct BwdConfig<T, 32> {
  using type = BwdTraits<T, 32, 128, 128, 8, 2, 4, 4, true>;
};
template <typename T>
struct BwdConfig<T, 64> {
  using type = BwdTraits<T, 64, 128, 128, 8, 2, 4, 4, true>;
};
template <typename T>
struct BwdConfig<T, 128> {
  using type = BwdTraits<T, 128, 64, 128, 8, 2, 4, 2, true>;
};
template <typename T>
struct BwdConfig<T, 256> {
  using type = BwdTraits<T, 256, 64, 64, 8, 4, 2, 2, false>;
};

// Checks that the extension has code for the current GPU (else cudaErrorNoKernelImageForDevice /
// cudaErrorInvalidDeviceFunction) and raises the kernel's dynamic smem limit; done once per
// (kernel, device) since these driver calls cost microseconds on every launch otherwise.
constexpr int kMaxDevices = 64;

// `ready` must be distinct per kernel: all kernels share one function-pointer type.
template <typename Kernel>
inline cudaError_t prepare_kernel(Kernel kernel, int smem, bool (&ready)[kMaxDevices]) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices && ready[dev]) return cudaSuccess;
  cudaFuncAttributes attr;
  err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  if (err == cudaSuccess && dev >= 0 && dev < kMaxDevices) ready[dev] = true;
  return err;
}

template <typename T, int D>
cudaError_t run_hstu_fwd(HstuParams& p, cudaStream_t stream) {
  using Kt = typename FwdConfig<T, D>::type;
  auto kernel = &hstu_fwd_kernel<Kt>;
  constexpr int smem = Kt::kSmemSize;
  static bool ready[kMaxDevices] = {};
  cudaError_t err = prepare_kernel(kernel, smem, ready);
  if (err != cudaSuccess) return err;
  dim3 grid((p.max_seqlen + Kt::kBlockM - 1) / Kt::kBlockM, p.batch, p.heads);
  if (grid.x == 0 || p.batch == 0 || p.heads == 0) return cudaSuccess;
  kernel<<<grid, Kt::kNThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t run_hstu_bwd(HstuParams& p, cudaStream_t stream) {
  using Kt = typename BwdConfig<T, D>::type;
  auto kernel = &hstu_bwd_kernel<Kt>;
  constexpr int smem = Kt::kSmemSize;
  static bool ready[kMaxDevices] = {};
  cudaError_t err = prepare_kernel(kernel, smem, ready);
  if (err != cudaSuccess) return err;
  dim3 grid((p.max_seqlen + Kt::kBlockN - 1) / Kt::kBlockN, p.batch, p.heads);
  if (grid.x > 0 && p.batch > 0 && p.heads > 0) {
    kernel<<<grid, Kt::kNThreads, smem, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t n = int64_t(p.total) * p.heads * p.head_dim;
  if (n > 0) {
    const int threads = 256;
    const int64_t blocks = (n / 4 + threads) / threads;
    hstu_convert_dq_kernel<T><<<dim3(unsigned(blocks)), threads, 0, stream>>>(
        p.dq_accum, reinterpret_cast<T*>(p.dq), n);
    err = cudaGetLastError();
  }
  return err;
}

// One instantiation file per (dtype, head dim, direction) registers its launcher at load time,
// so a build filtered with HSTU_KERNEL_DIMS links and reports what is missing at call time.
#define HSTU_REGISTER_FWD(T, DT, D)                                                   \
  namespace {                                                                         \
  const bool hstu_registered_fwd_##D = ::hstu::register_launcher(                     \
      ::hstu::Direction::kFwd, DT, D, &::hstu::run_hstu_fwd<T, D>);                   \
  }
#define HSTU_REGISTER_BWD(T, DT, D)                                                   \
  namespace {                                                                         \
  const bool hstu_registered_bwd_##D = ::hstu::register_launcher(                     \
      ::hstu::Direction::kBwd, DT, D, &::hstu::run_hstu_bwd<T, D>);                   \
  }

}  // namespace hstu
