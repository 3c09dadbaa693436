// Thread layout, 16-byte vector I/O and row reductions shared by the forward and backward.
//
// A row is split into 8-element chunks (one 16-byte vector each). A "row group" of WPR warps owns
// one row at a time: its thread t handles chunks t, t + 32*WPR, ... (ITERS of them), so every
// thread keeps its slice of the row in registers between the reduction and the write pass.
// Blocks have 4 warps: WPR = 1 -> 4 rows in flight per block (cols <= 1024), WPR = 4 -> one row
// per block (wider rows), which keeps ITERS <= 4 up to cols = 4096 (8 up to 8192).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "params.h"
#include "philox.h"

namespace lnmd {

template <int WPR_, int ITERS_>
struct Traits {
  static constexpr int WPR = WPR_;
  static constexpr int ITERS = ITERS_;
  static constexpr int TPR = 32 * WPR;               // threads per row
  static constexpr int RPB = kThreads / 32 / WPR;    // rows per block in flight
  static_assert(RPB * WPR * 32 == kThreads, "WPR must divide the warps of a block");
};

template <typename T>
struct Vec;

template <>
struct Vec<__nv_bfloat16> {
  static __device__ __forceinline__ void load(const void* p, float (&out)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  static __device__ __forceinline__ void store(void* p, const float (&in)[8]) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};

template <>
struct Vec<__half> {
  static __device__ __forceinline__ void load(const void* p, float (&out)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  static __device__ __forceinline__ void store(void* p, const float (&in)[8]) {
    uint4 raw;
    __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
};

// v rounded to T and back (what a store and a load of T would give).
template <typename T>
__device__ __forceinline__ void round8(float (&v)[8]) {
  uint4 raw;
  Vec<T>::store(&raw, v);
  Vec<T>::load(&raw, v);
}

// SiLU(x) = x * s, SiLU'(x) = s * (1 + x * (1 - s)), s = 1 / (1 + exp(-x)) (silu_kernel.h, and
// the gating kernels when they take u before its SiLU).
__device__ __forceinline__ float silu_f32(float x) { return x / (1.0f + __expf(-x)); }

__device__ __forceinline__ float silu_grad_f32(float x) {
  const float s = 1.0f / (1.0f + __expf(-x));
  return s * (1.0f + x * (1.0f - s));
}

__device__ __forceinline__ void load_f32x8(const float* p, float (&out)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

template <typename P>
__device__ __forceinline__ const char* row_ptr(const void* base, int64_t row, int64_t stride) {
  return static_cast<const char*>(base) + (row * stride) * static_cast<int64_t>(sizeof(P));
}

__device__ __forceinline__ float2 warp_sum2(float2 v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, off);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, off);
  }
  return v;
}

// Sum of two values over the WPR warps of this thread's row group. Every thread of the block
// must call it the same number of times when WPR > 1 (it synchronises the block).
template <int WPR>
__device__ __forceinline__ float2 group_sum2(float2 v, float2* smem /* [kThreads / 32] */) {
  v = warp_sum2(v);
  if constexpr (WPR == 1) {
    return v;
  } else {
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) smem[warp] = v;
    __syncthreads();
    float2 t = make_float2(0.f, 0.f);
    const int first = (warp / WPR) * WPR;
#pragma unroll
    for (int k = 0; k < WPR; ++k) {
      t.x += smem[first + k].x;
      t.y += smem[first + k].y;
    }
    __syncthreads();
    return t;
  }
}

// Per-block d weight / d bias of a backward kernel: the row groups 1.. hand their register sums
// to group 0 through shared memory (`part_smem`, [(RPB - 1), 2, cols]), which writes the block's
// [2, cols] partial (row 0: d weight, row 1: d bias). Every thread of the block must call it.
template <typename Tr>
__device__ __forceinline__ void write_weight_partials(float (&dw)[Tr::ITERS][8],
                                                      float (&db)[Tr::ITERS][8], float* partials,
                                                      int cols, float* part_smem, int group,
                                                      int tid) {
  const int nchunks = cols / 8;
  float* out = partials + static_cast<int64_t>(blockIdx.x) * 2 * cols;
  if constexpr (Tr::RPB > 1) {
    if (group > 0) {
      float* mine = part_smem + static_cast<int64_t>(group - 1) * 2 * cols;
#pragma unroll
      for (int i = 0; i < Tr::ITERS; ++i) {
        const int c = tid + i * Tr::TPR;
        if (c >= nchunks) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          mine[c * 8 + j] = dw[i][j];
          mine[cols + c * 8 + j] = db[i][j];
        }
      }
    }
    __syncthreads();
    if (group > 0) return;
#pragma unroll
    for (int i = 0; i < Tr::ITERS; ++i) {
      const int c = tid + i * Tr::TPR;
      if (c >= nchunks) continue;
      for (int g = 0; g < Tr::RPB - 1; ++g) {
        const float* other = part_smem + static_cast<int64_t>(g) * 2 * cols;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          dw[i][j] += other[c * 8 + j];
          db[i][j] += other[cols + c * 8 + j];
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < Tr::ITERS; ++i) {
    const int c = tid + i * Tr::TPR;
    if (c >= nchunks) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      out[c * 8 + j] = dw[i][j];
      out[cols + c * 8 + j] = db[i][j];
    }
  }
}

}  // namespace lnmd
