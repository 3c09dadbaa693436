// y = x rounded to T, for fp32 x [rows, cols], and the fp32 column sums of x, in one pass: the
// fused layer's incoming gradient (fp32 residual stream) cast for the output-projection matmuls
// plus that projection's bias gradient, which otherwise take a copy kernel and a reduction that
// reads the copy again. Column-owner layout (column_layout.h): 32-byte loads, 16-byte stores.
#pragma once

#include "column_layout.h"
#include "kernel_traits.h"

namespace lnmd {

template <typename T>
__global__ void __launch_bounds__(kColumnThreads) cast_colsum_kernel(const CastColsumParams p) {
  __shared__ float red[kColumnThreads][8];
  const int nchunks = p.cols / 8;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const float* xcol = p.x + static_cast<int64_t>(c) * 8;
  char* ycol = static_cast<char*>(p.y) + static_cast<int64_t>(c) * 16;
  const int64_t ys = static_cast<int64_t>(p.cols) * static_cast<int64_t>(sizeof(T));
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.f;
  if (c < nchunks) {
    for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r0 < p.rows;
         r0 += kColumnUnroll * step) {
      float4 lo[kColumnUnroll], hi[kColumnUnroll];
#pragma unroll
      for (int k = 0; k < kColumnUnroll; ++k) {
        const int64_t r = r0 + k * step;
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        const float4* src = reinterpret_cast<const float4*>(xcol + r * p.x_stride);
        lo[k] = r < p.rows ? src[0] : zero;
        hi[k] = r < p.rows ? src[1] : zero;
      }
#pragma unroll
      for (int k = 0; k < kColumnUnroll; ++k) {
        const int64_t r = r0 + k * step;
        if (r >= p.rows) break;
        const float v[8] = {lo[k].x, lo[k].y, lo[k].z, lo[k].w, hi[k].x, hi[k].y, hi[k].z, hi[k].w};
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += v[j];
        Vec<T>::store(ycol + r * ys, v);
      }
    }
  }
  store_column_partials(acc, red, p.partials, c, nchunks);
}

}  // namespace lnmd
