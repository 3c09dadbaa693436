// Launch of the token-assembly kernels (tokens_kernel.h). Torch-free; tokens_api.cpp calls these.
#include <algorithm>
#include <atomic>

#include "launch.h"
#include "tokens_kernel.h"

namespace lnmd {
namespace {

constexpr int kTokensThreads = 256;
constexpr int kTokensSmemMax = 96 * 1024;  // backward action sums per block, all lane groups
constexpr int kTokensGroupsPerSm = 4;      // backward lane groups per SM (partial rows written)

int row_threads(int nchunks) {
  int tx = 1;
  while (tx < nchunks && tx < 128) tx *= 2;
  return tx;
}

}  // namespace

int tokens_max_bits(int cols) {
  const int64_t row_bytes = static_cast<int64_t>(cols) * 4;
  return static_cast<int>(kTokensSmemMax / row_bytes) - 1;
}

TokensBwdShape tokens_bwd_shape(int cols, int num_bits, int64_t work, int num_sms) {
  const int tx = row_threads(cols / 8);
  int ty = kTokensThreads / tx;
  const int64_t group_bytes = static_cast<int64_t>(num_bits + 1) * cols * 4;
  while (ty > 1 && ty * group_bytes > kTokensSmemMax) ty /= 2;
  const int64_t want = std::max<int64_t>(1, int64_t(kTokensGroupsPerSm) * num_sms / ty);
  const int64_t needed = std::max<int64_t>(1, (work + ty - 1) / ty);
  const int grid = static_cast<int>(std::min(want, needed));
  return {tx, ty, grid, static_cast<int>(ty * group_bytes)};
}

void launch_tokens_fwd(const TokensFwdParams& p, int num_sms, cudaStream_t stream) {
  if (p.rows == 0) return;
  const int tx = row_threads(p.cols / 8);
  const int ty = kTokensThreads / tx;
  const int64_t needed = (p.rows + ty - 1) / ty;
  const int grid = static_cast<int>(std::min<int64_t>(needed, int64_t(num_sms) * 8));
  tokens_fwd_kernel<<<grid, dim3(tx, ty), 0, stream>>>(p);
}

// The backward's dynamic shared-memory limit is a per-device setting of the kernel: raised once
// on each device a process launches it on. A failed call leaves its error for the launch check.
namespace {
void raise_bwd_smem_limit() {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> raised[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return;
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached && raised[dev].load(std::memory_order_relaxed)) return;
  if (cudaFuncSetAttribute(tokens_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kTokensSmemMax) == cudaSuccess &&
      cached) {
    raised[dev].store(true, std::memory_order_relaxed);
  }
}
}  // namespace

void launch_tokens_bwd(const TokensBwdParams& p, const TokensBwdShape& s, cudaStream_t stream) {
  if (s.smem > 48 * 1024) raise_bwd_smem_limit();
  tokens_bwd_kernel<<<s.grid, dim3(s.tx, s.ty), s.smem, stream>>>(p);
}

}  // namespace lnmd
