// Launches of the chunk-major SiLU kernels (silu_kernel.h) for bf16 and fp16: block shape from
// the row width, grid from the occupancy. Torch-free; api.cpp calls these.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "launch.h"
#include "silu_kernel.h"

namespace lnmd {
namespace {

// (BX chunk columns) x (BY rows) threads: BX the chunk count of a row rounded up to a power of
// two, capped at the block size, so narrow rows still fill the block with several rows.
dim3 silu_block(int hd) {
  const int nchunks = hd / 2;  // 4 * hd / 8
  int bx = 1;
  while (bx < nchunks && bx < kSiluThreads) bx *= 2;
  return dim3(bx, kSiluThreads / bx);
}

template <typename Kernel>
int silu_blocks_per_sm(Kernel kernel) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kSiluThreads, 0) !=
          cudaSuccess ||
      per_sm < 1) {
    cudaGetLastError();  // clear a failed query; one block per SM still runs correctly
    per_sm = 1;
  }
  return per_sm;
}

// Blocks along the rows: enough for every resident slot of the GPU, never more than the rows.
int silu_grid_y(int hd, int64_t rows, int per_sm, int num_sms) {
  const dim3 block = silu_block(hd);
  const int gx = (hd / 2 + static_cast<int>(block.x) - 1) / static_cast<int>(block.x);
  const int64_t want = std::max<int64_t>(1, int64_t(per_sm) * num_sms / gx);
  const int64_t needed = (rows + block.y - 1) / block.y;
  return static_cast<int>(std::max<int64_t>(1, std::min(want, needed)));
}

template <typename T>
int silu_bwd_per_sm() {
  static const int per_sm = silu_blocks_per_sm(silu_bwd_kernel<T>);
  return per_sm;
}

template <typename T>
void run_silu_fwd(const SiluFwdParams& p, int num_sms, cudaStream_t stream) {
  if (p.rows == 0) return;
  static const int per_sm = silu_blocks_per_sm(silu_fwd_kernel<T>);
  const dim3 block = silu_block(p.hd);
  const dim3 grid((p.hd / 2 + block.x - 1) / block.x, silu_grid_y(p.hd, p.rows, per_sm, num_sms));
  silu_fwd_kernel<T><<<grid, block, 0, stream>>>(p);
}

template <typename T>
void run_silu_bwd(const SiluBwdParams& p, int grid_y, cudaStream_t stream) {
  if (p.rows == 0 || grid_y == 0) return;
  const dim3 block = silu_block(p.hd);
  const dim3 grid((p.hd / 2 + block.x - 1) / block.x, grid_y);
  silu_bwd_kernel<T><<<grid, block, 0, stream>>>(p);
}

}  // namespace

int silu_bwd_grid(DType dtype, int hd, int64_t rows, int num_sms) {
  if (rows == 0) return 0;
  const int per_sm = dtype == DType::kBF16 ? silu_bwd_per_sm<__nv_bfloat16>()
                                           : silu_bwd_per_sm<__half>();
  return silu_grid_y(hd, rows, per_sm, num_sms);
}

void launch_silu_fwd(DType dtype, const SiluFwdParams& p, int num_sms, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    run_silu_fwd<__nv_bfloat16>(p, num_sms, stream);
  } else {
    run_silu_fwd<__half>(p, num_sms, stream);
  }
}

void launch_silu_bwd(DType dtype, const SiluBwdParams& p, int grid_y, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    run_silu_bwd<__nv_bfloat16>(p, grid_y, stream);
  } else {
    run_silu_bwd<__half>(p, grid_y, stream);
  }
}

}  // namespace lnmd
