// Forward: y = dropout(LayerNorm(x) * u), plus LayerNorm's per-row mean and rstd (fp32).
// Math in fp32: mean, then the variance from the deviations kept in registers (two passes over
// registers, not over memory), rstd = 1 / sqrt(var + eps).
#pragma once

#include "kernel_traits.h"

namespace lnmd {

template <typename T, typename Tr>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const FwdParams p) {
  __shared__ float2 smem[kThreads / 32];
  const int group = threadIdx.x / 32 / Tr::WPR;
  const int tid = threadIdx.x % Tr::TPR;
  const int nchunks = p.cols / 8;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  const bool dropout = p.dropout.threshold != 0u;
  const uint64_t drop_seed =
      p.dropout.seed_offset ? static_cast<uint64_t>(p.dropout.seed_offset[0]) : p.dropout.seed;
  const uint64_t drop_offset =
      p.dropout.seed_offset ? static_cast<uint64_t>(p.dropout.seed_offset[1]) : p.dropout.offset;

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * Tr::RPB; base < p.rows;
       base += static_cast<int64_t>(gridDim.x) * Tr::RPB) {
    const int64_t row = base + group;
    const bool active = row < p.rows;  // uniform over the row group
    const char* xrow = row_ptr<T>(p.x, row, p.x_stride);

    const char* urow = row_ptr<T>(p.u, row, p.u_stride);
    float xv[Tr::ITERS][8];
    uint4 uraw[Tr::ITERS];  // u is loaded with x, so its latency hides behind the reductions
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < Tr::ITERS; ++i) {
      const int c = tid + i * Tr::TPR;
      if (active && c < nchunks) {
        Vec<T>::load(xrow + c * 16, xv[i]);
        uraw[i] = *reinterpret_cast<const uint4*>(urow + c * 16);
#pragma unroll
        for (int j = 0; j < 8; ++j) s += xv[i][j];
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[i][j] = 0.f;
      }
    }
    const float mean = group_sum2<Tr::WPR>(make_float2(s, 0.f), smem).x * inv_cols;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < Tr::ITERS; ++i) {
      const int c = tid + i * Tr::TPR;
      if (active && c < nchunks) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float d = xv[i][j] - mean;
          ss += d * d;
        }
      }
    }
    const float var = group_sum2<Tr::WPR>(make_float2(ss, 0.f), smem).x * inv_cols;
    const float rstd = rsqrtf(var + p.eps);
    if (!active) continue;  // after the last block-wide reduction of this row
    if (tid == 0) {
      p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    char* yrow = static_cast<char*>(p.y) + row * p.y_stride * static_cast<int64_t>(sizeof(T));
#pragma unroll
    for (int i = 0; i < Tr::ITERS; ++i) {
      const int c = tid + i * Tr::TPR;
      if (c >= nchunks) continue;
      float uv[8], w[8], b[8], out[8];
      Vec<T>::load(&uraw[i], uv);
      if (p.u_silu) {  // u = SiLU(z_u) as the SiLU kernel would have stored it
#pragma unroll
        for (int j = 0; j < 8; ++j) uv[j] = silu_f32(uv[j]);
        round8<T>(uv);
      }
      load_f32x8(p.weight + c * 8, w);
      load_f32x8(p.bias + c * 8, b);
      uint32_t keep = 0xFFu;
      if (dropout) {
        keep = keep_bits(static_cast<uint64_t>(row) * nchunks + c, drop_seed,
                         drop_offset, p.dropout.threshold);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float g = ((xv[i][j] - mean) * rstd * w[j] + b[j]) * uv[j];
        out[j] = ((keep >> j) & 1u) ? g * p.dropout.scale : 0.f;
      }
      Vec<T>::store(yrow + c * 16, out);
    }
  }
}

}  // namespace lnmd
