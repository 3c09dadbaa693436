// Layout shared by the column-owner kernels (silu_kernel.h, cast_kernel.h): a thread owns one
// 8-element chunk column of a [rows, 8 * nchunks] tensor for the whole launch and walks the rows
// grid-stride; per-column sums are kept in registers and written as one fp32 partial row per
// block row. Torch-free: launch shapes (host) and the block's column-sum epilogue (device).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace lnmd {

constexpr int kColumnThreads = 256;
constexpr int kColumnUnroll = 4;  // rows loaded per thread before any math

// (BX chunk columns) x (BY rows) threads: BX the chunk count rounded up to a power of two,
// capped at the block size, so narrow rows still fill the block with several rows.
inline dim3 column_block(int nchunks) {
  int bx = 1;
  while (bx < nchunks && bx < kColumnThreads) bx *= 2;
  return dim3(bx, kColumnThreads / bx);
}

inline int column_grid_x(int nchunks) {
  const int bx = static_cast<int>(column_block(nchunks).x);
  return (nchunks + bx - 1) / bx;
}

// Blocks along the rows: enough for every resident slot of the GPU, never more than the rows.
inline int column_grid_y(int nchunks, int64_t rows, int per_sm, int num_sms) {
  const int64_t want = std::max<int64_t>(1, int64_t(per_sm) * num_sms / column_grid_x(nchunks));
  const int64_t needed = (rows + column_block(nchunks).y - 1) / column_block(nchunks).y;
  return static_cast<int>(std::max<int64_t>(1, std::min(want, needed)));
}

// Resident blocks per SM of `kernel` at kColumnThreads threads (callers cache it per kernel).
template <typename Kernel>
int column_blocks_per_sm(Kernel kernel) {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kColumnThreads, 0) !=
          cudaSuccess ||
      per_sm < 1) {
    cudaGetLastError();  // clear a failed query; one block per SM still runs correctly
    per_sm = 1;
  }
  return per_sm;
}

// Adds acc (this thread's 8 column sums) over the BY row lanes of the block and writes the
// block's fp32 partial row: partials[blockIdx.y, 8 * c .. 8 * c + 7] (row width 8 * nchunks).
// Every thread of the block must call it (it synchronises when BY > 1).
__device__ __forceinline__ void store_column_partials(float (&acc)[8],
                                                      float (*red)[8] /* [kColumnThreads] */,
                                                      float* partials, int c, int nchunks) {
  if (blockDim.y > 1) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
    for (int j = 0; j < 8; ++j) red[tid][j] = acc[j];
    __syncthreads();
    if (threadIdx.y != 0) return;
    for (int y = 1; y < static_cast<int>(blockDim.y); ++y) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += red[y * blockDim.x + threadIdx.x][j];
    }
  }
  if (c >= nchunks) return;
  float4* dst = reinterpret_cast<float4*>(partials + static_cast<int64_t>(blockIdx.y) * 8 * nchunks +
                                          static_cast<int64_t>(c) * 8);
  dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

}  // namespace lnmd
