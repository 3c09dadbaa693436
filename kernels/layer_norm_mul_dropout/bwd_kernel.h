// Backward of y = dropout(LayerNorm(x) * u) given dy (the forward's mask regenerated from the
// seed): with ln = xhat * w + b, xhat = (x - mean) * rstd, dg = keep * scale * dy,
//   du = dg * ln,   dln = dg * u,   d weight = sum_rows dln * xhat,   d bias = sum_rows dln,
//   dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dln * w.
// Optionally re-emits y (the output projection's weight gradient needs it). With u_silu, u is
// the pre-activation z_u (u = SiLU(z_u) rounded to T) and du is written as du * SiLU'(z_u),
// straight into the u block of the fused layer's dz. Each block sums
// d weight / d bias over its rows in registers and writes one [2, cols] partial; api.cpp adds
// the partials of all blocks.
#pragma once

#include "kernel_traits.h"

namespace lnmd {

template <typename T, typename Tr>
__global__ void __launch_bounds__(kThreads) bwd_kernel(const BwdParams p) {
  __shared__ float2 smem[kThreads / 32];
  extern __shared__ float part_smem[];  // [(RPB - 1), 2, cols] when RPB > 1
  const int group = threadIdx.x / 32 / Tr::WPR;
  const int tid = threadIdx.x % Tr::TPR;
  const int nchunks = p.cols / 8;
  const float inv_cols = 1.0f / static_cast<float>(p.cols);
  const bool dropout = p.dropout.threshold != 0u;
  const uint64_t drop_seed =
      p.dropout.seed_offset ? static_cast<uint64_t>(p.dropout.seed_offset[0]) : p.dropout.seed;
  const uint64_t drop_offset =
      p.dropout.seed_offset ? static_cast<uint64_t>(p.dropout.seed_offset[1]) : p.dropout.offset;

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
      const char* xrow = row_ptr<T>(p.x, row, p.x_stride);
      const char* urow = row_ptr<T>(p.u, row, p.u_stride);
      const char* dyrow = row_ptr<T>(p.dy, row, p.dy_stride);
      const int64_t out_off = row * static_cast<int64_t>(p.cols) * sizeof(T);
      const int64_t du_off = row * p.du_stride * static_cast<int64_t>(sizeof(T));
#pragma unroll
      for (int i = 0; i < Tr::ITERS; ++i) {
        const int c = tid + i * Tr::TPR;
        if (c >= nchunks) {
#pragma unroll
          for (int j = 0; j < 8; ++j) xhat[i][j] = dxh[i][j] = 0.f;
          continue;
        }
        float xv[8], uv[8], g[8], w[8], b[8], du[8], y[8];
        Vec<T>::load(xrow + c * 16, xv);
        Vec<T>::load(urow + c * 16, uv);
        float zu[8];  // the pre-activation when u_silu
        if (p.u_silu) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            zu[j] = uv[j];
            uv[j] = silu_f32(zu[j]);
          }
          round8<T>(uv);
        }
        Vec<T>::load(dyrow + c * 16, g);
        load_f32x8(p.weight + c * 8, w);
        load_f32x8(p.bias + c * 8, b);
        uint32_t keep = 0xFFu;
        if (dropout) {
          keep = keep_bits(static_cast<uint64_t>(row) * nchunks + c, drop_seed,
                           drop_offset, p.dropout.threshold);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const bool kept = (keep >> j) & 1u;
          const float xh = (xv[j] - mean) * rstd;
          const float ln = xh * w[j] + b[j];
          const float dg = kept ? g[j] * p.dropout.scale : 0.f;
          du[j] = dg * ln;
          y[j] = kept ? ln * uv[j] * p.dropout.scale : 0.f;
          const float dln = dg * uv[j];
          dw[i][j] += dln * xh;
          db[i][j] += dln;
          xhat[i][j] = xh;
          dxh[i][j] = dln * w[j];
          s.x += dxh[i][j];
          s.y += dxh[i][j] * xh;
        }
        if (p.u_silu) {  // dz_u = du (as the unfused path stores it) * SiLU'(z_u)
          round8<T>(du);
#pragma unroll
          for (int j = 0; j < 8; ++j) du[j] *= silu_grad_f32(zu[j]);
        }
        Vec<T>::store(static_cast<char*>(p.du) + du_off + c * 16, du);
        if (p.y != nullptr) Vec<T>::store(static_cast<char*>(p.y) + out_off + c * 16, y);
      }
    }
    s = group_sum2<Tr::WPR>(s, smem);
    if (!active) continue;
    const float m1 = s.x * inv_cols, m2 = s.y * inv_cols;
    char* dxrow = static_cast<char*>(p.dx) + row * static_cast<int64_t>(p.cols) * sizeof(T);
#pragma unroll
    for (int i = 0; i < Tr::ITERS; ++i) {
      const int c = tid + i * Tr::TPR;
      if (c >= nchunks) continue;
      float dx[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) dx[j] = rstd * (dxh[i][j] - m1 - xhat[i][j] * m2);
      Vec<T>::store(dxrow + c * 16, dx);
    }
  }

  write_weight_partials<Tr>(dw, db, p.partials, p.cols, part_smem, group, tid);
}

}  // namespace lnmd
