// The HSTU layer's input LayerNorm on the fp32 residual stream (no gating, no dropout):
//   forward:  n = LayerNorm(x) in 16 bits, plus the per-row mean and rstd (fp32);
//   backward: dx = dres + rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
//             dxhat = dn * w,  d weight = sum_rows dn * xhat,  d bias = sum_rows dn,
// where dres is the gradient already flowing into x through the residual connection (so the
// layer's input gradient leaves in one pass). x, dres and dx are fp32; dn and n are bf16/fp16.
// Same row layout, reductions and per-block weight/bias partials as the gating kernels.
#pragma once

#include "kernel_traits.h"

namespace lnmd {

template <typename T, typename Tr>
__global__ void __launch_bounds__(kThreads) ln_fwd_kernel(const LnFwdParams p) {
  __shared__ float2 smem[kThreads / 32];
  const int group = threadIdx.x / 32 / Tr::WPR;
  const int tid = threadIdx.x % Tr::TPR;
  const int nchunks = p.cols / 8;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * Tr::RPB; base < p.rows;
       base += static_cast<int64_t>(gridDim.x) * Tr::RPB) {
    const int64_t row = base + group;
    const bool active = row < p.rows;  // uniform over the row group
    const float* xrow = p.x + row * p.x_stride;
    float xv[Tr::ITERS][8];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < Tr::ITERS; ++i) {
      const int c = tid + i * Tr::TPR;
      if (active && c < nchunks) {
        load_f32x8(xrow + c * 8, xv[i]);
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
    char* nrow = static_cast<char*>(p.n) + row * static_cast<int64_t>(p.cols) * sizeof(T);
#pragma unroll
    for (int i = 0; i < Tr::ITERS; ++i) {
      const int c = tid + i * Tr::TPR;
      if (c >= nchunks) continue;
      float w[8], b[8], out[8];
      load_f32x8(p.weight + c * 8, w);
      load_f32x8(p.bias + c * 8, b);
#pragma unroll
      for (int j = 0; j < 8; ++j) out[j] = (xv[i][j] - mean) * rstd * w[j] + b[j];
      Vec<T>::store(nrow + c * 16, out);
    }
  }
}

template <typename T, typename Tr>
__global__ void __launch_bounds__(kThreads) ln_bwd_kernel(const LnBwdParams p) {
  __shared__ float2 smem[kThreads / 32];
  extern __shared__ float part_smem[];  // [(RPB - 1), 2, cols] when RPB > 1
  const int group = threadIdx.x / 32 / Tr::WPR;
  const int tid = threadIdx.x % Tr::TPR;
  const int nchunks = p.cols / 8;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);

  float dw[Tr::ITERS][8], db[Tr::ITERS][8];
#pragma unroll
  for (int i = 0; i < Tr::ITERS; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) dw[i][j] = db[i][j] = 0.f;
  }

  for (int64_t base = static_cast<int64_t>(blockIdx.x) * Tr::RPB; base < p.rows;
       base += static_cast<int64_t>(gridDim.x) * Tr::RPB) {
    const int64_t row = base + group;
    const bool active = row < p.rows;  // uniform over the row group
    float xhat[Tr::ITERS][8], dxh[Tr::ITERS][8];
    float2 s = make_float2(0.f, 0.f);
    float rstd = 0.f;
    if (active) {
      const float mean = p.mean[row];
      rstd = p.rstd[row];
      const float* xrow = p.x + row * p.x_stride;
      const char* dnrow = row_ptr<T>(p.dn, row, p.dn_stride);
#pragma unroll
      for (int i = 0; i < Tr::ITERS; ++i) {
        const int c = tid + i * Tr::TPR;
        if (c >= nchunks) {
#pragma unroll
          for (int j = 0; j < 8; ++j) xhat[i][j] = dxh[i][j] = 0.f;
          continue;
        }
        float xv[8], g[8], w[8];
        load_f32x8(xrow + c * 8, xv);
        Vec<T>::load(dnrow + c * 16, g);
        load_f32x8(p.weight + c * 8, w);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xh = (xv[j] - mean) * rstd;
          dw[i][j] += g[j] * xh;
          db[i][j] += g[j];
          xhat[i][j] = xh;
          dxh[i][j] = g[j] * w[j];
          s.x += dxh[i][j];
          s.y += dxh[i][j] * xh;
        }
      }
    }
    s = group_sum2<Tr::WPR>(s, smem);
    if (!active) continue;
    const float m1 = s.x * inv_cols, m2 = s.y * inv_cols;
    const float* rrow = p.dres + row * p.dres_stride;
    float* dxrow = p.dx + row * static_cast<int64_t>(p.cols);
#pragma unroll
    for (int i = 0; i < Tr::ITERS; ++i) {
      const int c = tid + i * Tr::TPR;
      if (c >= nchunks) continue;
      float r[8];
      load_f32x8(rrow + c * 8, r);
      float4 lo, hi;
      lo.x = r[0] + rstd * (dxh[i][0] - m1 - xhat[i][0] * m2);
      lo.y = r[1] + rstd * (dxh[i][1] - m1 - xhat[i][1] * m2);
      lo.z = r[2] + rstd * (dxh[i][2] - m1 - xhat[i][2] * m2);
      lo.w = r[3] + rstd * (dxh[i][3] - m1 - xhat[i][3] * m2);
      hi.x = r[4] + rstd * (dxh[i][4] - m1 - xhat[i][4] * m2);
      hi.y = r[5] + rstd * (dxh[i][5] - m1 - xhat[i][5] * m2);
      hi.z = r[6] + rstd * (dxh[i][6] - m1 - xhat[i][6] * m2);
      hi.w = r[7] + rstd * (dxh[i][7] - m1 - xhat[i][7] * m2);
      reinterpret_cast<float4*>(dxrow + c * 8)[0] = lo;
      reinterpret_cast<float4*>(dxrow + c * 8)[1] = hi;
    }
  }
  write_weight_partials<Tr>(dw, db, p.partials, p.cols, part_smem, group, tid);
}

}  // namespace lnmd
