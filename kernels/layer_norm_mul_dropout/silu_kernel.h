// SiLU of the fused layer's uvqk projection, written chunk-major, and its backward.
//
//   forward:  act[b, r, :] = SiLU(z[r, b*hd:(b+1)*hd])           b = 0..3 (u, v, q, k)
//   backward: dz[r, b*hd:(b+1)*hd] = grad_b[r, :] * SiLU'(z[r, b*hd:(b+1)*hd])
//             (+ optionally the column sums of dz as rounded to T: the uvqk bias gradient);
//             grad_2 (dq) either T or the attention's fp32 head-major accumulator; with
//             u_prefilled, block 0 of dz is given (the gating kernel wrote it) and only summed
//   forward with first_block = 1: SiLU of v, q, k only (the gating kernel applies u's itself)
//
// SiLU(x) = x * s, SiLU'(x) = s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x)); math in fp32.
//
// Layout: a thread owns one 8-element (16-byte) chunk column c of z / dz for the whole launch
// (so its block index b, its source/destination pointers and, in backward, its 8 bias-gradient
// accumulators stay in registers) and walks rows grid-stride, kSiluUnroll rows per step with all
// loads issued before any math. Blocks are (BX chunk columns) x (BY rows), BX * BY =
// kSiluThreads; consecutive threads read consecutive 16-byte chunks of one row (coalesced), and
// write consecutive chunks of one row of one act block (column_layout.h: shapes).
#pragma once

#include "column_layout.h"
#include "kernel_traits.h"

namespace lnmd {

constexpr int kSiluThreads = kColumnThreads;
constexpr int kSiluUnroll = kColumnUnroll;

template <typename T>
__global__ void __launch_bounds__(kSiluThreads) silu_fwd_kernel(const SiluFwdParams p) {
  const int hdc = p.hd / 8;  // chunks per (u | v | q | k) block
  // blocks first_block..3 only: act holds 4 - first_block of them
  const int c = blockIdx.x * blockDim.x + threadIdx.x + p.first_block * hdc;
  if (c >= 4 * hdc) return;
  const int b = c / hdc;
  const int ci = c - b * hdc;
  const char* zcol = static_cast<const char*>(p.z) + static_cast<int64_t>(c) * 16;
  char* acol = static_cast<char*>(p.act) + (static_cast<int64_t>(b - p.first_block) * p.rows *
                                                p.hd + static_cast<int64_t>(ci) * 8) *
                                               static_cast<int64_t>(sizeof(T));
  const int64_t zs = p.z_stride * static_cast<int64_t>(sizeof(T));
  const int64_t as = static_cast<int64_t>(p.hd) * static_cast<int64_t>(sizeof(T));
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r0 < p.rows;
       r0 += kSiluUnroll * step) {
    uint4 raw[kSiluUnroll];
#pragma unroll
    for (int k = 0; k < kSiluUnroll; ++k) {
      const int64_t r = r0 + k * step;
      raw[k] = r < p.rows ? *reinterpret_cast<const uint4*>(zcol + r * zs) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kSiluUnroll; ++k) {
      const int64_t r = r0 + k * step;
      if (r >= p.rows) break;
      float v[8];
      Vec<T>::load(&raw[k], v);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = silu_f32(v[j]);
      Vec<T>::store(acol + r * as, v);
    }
  }
}

// kDqF32: the q block's gradient is p.grad2_f32 (fp32, head-major); its columns load two
// 16-byte fp32 vectors per row, the other blocks' columns are unchanged.
template <typename T, bool kDqF32 = false>
__global__ void __launch_bounds__(kSiluThreads) silu_bwd_kernel(const SiluBwdParams p) {
  __shared__ float red[kSiluThreads][8];  // bias-gradient partials of the block's row lanes
  const int hdc = p.hd / 8;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const bool col_ok = c < 4 * hdc;
  const int b = col_ok ? c / hdc : 0;
  const int ci = c - b * hdc;
  // the gradient block this column reads (a select chain: no dynamic indexing into params)
  const void* g = b == 0 ? p.grad0 : b == 1 ? p.grad1 : b == 2 ? p.grad2 : p.grad3;
  const int64_t gstride =
      b == 0 ? p.grad_stride0 : b == 1 ? p.grad_stride1 : b == 2 ? p.grad_stride2 : p.grad_stride3;
  const int64_t tsize = static_cast<int64_t>(sizeof(T));
  const char* gcol = static_cast<const char*>(g) + static_cast<int64_t>(ci) * 16;
  const char* zcol = static_cast<const char*>(p.z) + static_cast<int64_t>(c) * 16;
  char* dcol = static_cast<char*>(p.dz) + static_cast<int64_t>(c) * 16;
  const int64_t gs = gstride * tsize, zs = p.z_stride * tsize, ds = p.dz_stride * tsize;
  // fp32 q-block column: head h = e / head_dim of the column's first element e, rows head_dim
  // floats apart inside the head's [rows, head_dim] slab
  const bool f32 = kDqF32 && b == 2;
  const float* fcol = nullptr;
  if (f32) {
    const int e = ci * 8;
    const int h = e / p.head_dim;
    fcol = p.grad2_f32 + static_cast<int64_t>(h) * p.rows * p.head_dim + (e - h * p.head_dim);
  }
  const bool bias = p.partials != nullptr;
  // block 0 of dz already written (the gating kernel's dz_u): its columns only add to the bias
  const bool prefilled = p.u_prefilled && b == 0;
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;

  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = 0.f;
  if (col_ok) {
    for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r0 < p.rows;
         r0 += kSiluUnroll * step) {
      // graw[k][0] holds 8 16-bit gradients, or with graw[k][1] 8 fp32 ones (fp32 dq column)
      uint4 zraw[kSiluUnroll], graw[kSiluUnroll][kDqF32 ? 2 : 1];
#pragma unroll
      for (int k = 0; k < kSiluUnroll; ++k) {
        const int64_t r = r0 + k * step;
        const bool in = r < p.rows;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        if (prefilled) {
          graw[k][0] = in ? *reinterpret_cast<const uint4*>(dcol + r * ds) : zero;
          continue;
        }
        zraw[k] = in ? *reinterpret_cast<const uint4*>(zcol + r * zs) : zero;
        if constexpr (kDqF32) {
          if (f32) {
            const uint4* src = reinterpret_cast<const uint4*>(fcol + r * p.head_dim);
            graw[k][0] = in ? src[0] : zero;
            graw[k][1] = in ? src[1] : zero;
            continue;
          }
        }
        graw[k][0] = in ? *reinterpret_cast<const uint4*>(gcol + r * gs) : zero;
      }
#pragma unroll
      for (int k = 0; k < kSiluUnroll; ++k) {
        const int64_t r = r0 + k * step;
        if (r >= p.rows) break;
        float zv[8], gv[8];
        if (prefilled) {
          if (bias) {
            Vec<T>::load(&graw[k][0], gv);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] += gv[j];
          }
          continue;
        }
        Vec<T>::load(&zraw[k], zv);
        bool loaded = false;
        if constexpr (kDqF32) {
          if (f32) {
            const float* f = reinterpret_cast<const float*>(graw[k]);
#pragma unroll
            for (int j = 0; j < 8; ++j) gv[j] = f[j];
            loaded = true;
          }
        }
        if (!loaded) Vec<T>::load(&graw[k][0], gv);
#pragma unroll
        for (int j = 0; j < 8; ++j) gv[j] *= silu_grad_f32(zv[j]);
        uint4 out;
        Vec<T>::store(&out, gv);
        *reinterpret_cast<uint4*>(dcol + r * ds) = out;
        if (bias) {  // sum what was stored (the rounded dz), as dz.sum(0, dtype=float32) would
          Vec<T>::load(&out, gv);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] += gv[j];
        }
      }
    }
  }
  if (!bias) return;  // uniform over the grid
  store_column_partials(acc, red, p.partials, c, 4 * hdc);
}

}  // namespace lnmd
