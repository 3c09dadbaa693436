// The sequence preprocessor's token assembly in one pass each way (tokens.cu launches these).
//
// Forward, per row r of x [rows, cols] (fp32), from the row's source row_src[r]:
//   item t >= 0:   v = (values[t] * item_scale + pos_weight[pos_ids[t]]) + act_table[code(t)]
//                  (the last term only for a history item, code(t) = actions[action_index[t]] &
//                  action_mask; candidates have action_index -1), each op rounded as the PyTorch
//                  path rounds it (no fused multiply-add);
//   context -2-k:  v = ctx[k];
//   padding -1:    v = 0;
// then x[r] = dropout(v), the keep mask a pure function of (seed, offset, r, col) (philox.h, the
// same mask the LayerNorm * u * dropout kernels draw for a [rows, cols] tensor).
//
// Backward, from dx [rows, cols]: g = dx * keep * scale on the rows read. Work items are the
// positions (the items of position p are pos_order[pos_offsets[p] .. pos_offsets[p + 1]), in
// item order) and then the contextual rows: for each item t of position p,
// d_values[t] = g(dest[t]) * item_scale and d_pos[p] = sum of g over the position's items, in
// order (deterministic, no atomics); a history item adds g to the sums of the action bits set in
// its code and to the history sum (rows 0 .. bits - 1 and bits of a per-lane-group partial
// buffer [groups, bits + 1, cols], summed by the caller in a fixed order); d_ctx[k] = g(ctx_rows[k]).
// A lane group (threadIdx.y of a block) owns its work items and its partial row set; each thread
// owns 8-column chunks of every row it touches, so shared memory needs no synchronisation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "philox.h"
#include "params.h"

namespace lnmd {

__device__ __forceinline__ void load8(const float* __restrict__ src, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

__device__ __forceinline__ void store8(float* __restrict__ dst, const float (&v)[8]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

struct SeedPair {
  uint64_t seed;
  uint64_t offset;
};

__device__ __forceinline__ SeedPair read_seed(const Dropout& d) {
  if (d.seed_offset != nullptr) {
    return {static_cast<uint64_t>(d.seed_offset[0]), static_cast<uint64_t>(d.seed_offset[1])};
  }
  return {d.seed, d.offset};
}

// v *= keep * scale for the 8 elements of chunk `chunk` (no-op without dropout).
__device__ __forceinline__ void apply_keep(float (&v)[8], uint64_t chunk, const SeedPair& s,
                                           const Dropout& d) {
  if (d.threshold == 0u) return;
  const uint32_t bits = keep_bits(chunk, s.seed, s.offset, d.threshold);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = (bits >> k) & 1u ? __fmul_rn(v[k], d.scale) : 0.f;
}

// Rows (forward) and items (backward) a thread handles at once: their index loads, then their
// row loads, are issued together (each row's sources are a chain of dependent index loads).
constexpr int kTokBatch = 4;

__global__ void __launch_bounds__(256) tokens_fwd_kernel(const TokensFwdParams p) {
  const int nchunks = p.cols / 8;
  const SeedPair sp = read_seed(p.dropout);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; r0 < p.rows;
       r0 += kTokBatch * step) {
    int64_t src[kTokBatch], pid[kTokBatch], ai[kTokBatch], code[kTokBatch];
#pragma unroll
    for (int i = 0; i < kTokBatch; ++i) {
      const int64_t r = r0 + i * step;
      src[i] = r < p.rows ? p.row_src[r] : -1;
    }
#pragma unroll
    for (int i = 0; i < kTokBatch; ++i) {
      pid[i] = src[i] >= 0 ? p.pos_ids[src[i]] : 0;
      ai[i] = src[i] >= 0 ? p.action_index[src[i]] : -1;
    }
#pragma unroll
    for (int i = 0; i < kTokBatch; ++i) code[i] = ai[i] >= 0 ? p.actions[ai[i]] & p.action_mask : -1;
    for (int j = threadIdx.x; j < nchunks; j += blockDim.x) {
      float v[kTokBatch][8], q[kTokBatch][8], a[kTokBatch][8];
#pragma unroll
      for (int i = 0; i < kTokBatch; ++i) {
        if (src[i] >= 0) {
          load8(p.values + src[i] * p.values_stride + 8 * j, v[i]);
          load8(p.pos_weight + pid[i] * p.cols + 8 * j, q[i]);
          if (code[i] >= 0) load8(p.act_table + code[i] * p.cols + 8 * j, a[i]);
        } else if (src[i] <= -2) {
          load8(p.ctx + (-2 - src[i]) * p.cols + 8 * j, v[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kTokBatch; ++i) {
        const int64_t r = r0 + i * step;
        if (r >= p.rows) break;
        float out[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          if (src[i] >= 0) {
            const float s = p.scale_items ? __fmul_rn(v[i][k], p.item_scale) : v[i][k];
            out[k] = __fadd_rn(s, q[i][k]);
            if (code[i] >= 0) out[k] = __fadd_rn(out[k], a[i][k]);
          } else {
            out[k] = src[i] <= -2 ? v[i][k] : 0.f;
          }
        }
        apply_keep(out, static_cast<uint64_t>(r) * nchunks + j, sp, p.dropout);
        store8(p.x + r * p.cols + 8 * j, out);
      }
    }
  }
}

// g of one item's row chunk: the incoming gradient at row `row`, masked and scaled.
__device__ __forceinline__ void grad_chunk(const TokensBwdParams& p, int64_t row, int j,
                                           int nchunks, const SeedPair& sp, float (&g)[8]) {
  load8(p.grad + row * p.grad_stride + 8 * j, g);
  apply_keep(g, static_cast<uint64_t>(row) * nchunks + j, sp, p.dropout);
}

// One item's share of a position's work: its value gradient, the position sum, the action sums.
__device__ __forceinline__ void item_grad(const TokensBwdParams& p, int64_t t, int64_t code,
                                          int j, const float (&g)[8], float (&acc)[8],
                                          float* __restrict__ sacc) {
  float dv[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    acc[k] += g[k];
    dv[k] = p.scale_items ? __fmul_rn(g[k], p.item_scale) : g[k];
  }
  store8(p.d_values + t * p.cols + 8 * j, dv);
  if (code < 0) return;  // a candidate: no action term
  for (int b = 0; b <= p.num_bits; ++b) {
    // row num_bits: the history sum (every history item)
    if (b < p.num_bits && !((code >> b) & 1)) continue;
    float4* s = reinterpret_cast<float4*>(sacc + static_cast<int64_t>(b) * p.cols + 8 * j);
    const float4 lo = s[0], hi = s[1];
    s[0] = make_float4(lo.x + g[0], lo.y + g[1], lo.z + g[2], lo.w + g[3]);
    s[1] = make_float4(hi.x + g[4], hi.y + g[5], hi.z + g[6], hi.w + g[7]);
  }
}

__global__ void __launch_bounds__(256) tokens_bwd_kernel(const TokensBwdParams p) {
  extern __shared__ float smem[];
  const int nchunks = p.cols / 8;
  const int rows_per_group = p.num_bits + 1;
  float* sacc = smem + static_cast<int64_t>(threadIdx.y) * rows_per_group * p.cols;
  for (int b = 0; b < rows_per_group; ++b) {
    for (int j = threadIdx.x; j < nchunks; j += blockDim.x) {
      const float zero[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      store8(sacc + static_cast<int64_t>(b) * p.cols + 8 * j, zero);
    }
  }
  const SeedPair sp = read_seed(p.dropout);
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const int64_t work = p.num_positions + p.num_ctx;
  for (int64_t w = group; w < work; w += groups) {
    if (w >= p.num_positions) {  // a contextual row
      const int64_t c = w - p.num_positions;
      const int64_t row = p.ctx_rows[c];
      for (int j = threadIdx.x; j < nchunks; j += blockDim.x) {
        float g[8];
        grad_chunk(p, row, j, nchunks, sp, g);
        store8(p.d_ctx + c * p.cols + 8 * j, g);
      }
      continue;
    }
    const int64_t k0 = p.pos_offsets[w];
    const int64_t k1 = p.pos_offsets[w + 1];
    for (int j = threadIdx.x; j < nchunks; j += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = 0.f;
      for (int64_t k = k0; k < k1; k += kTokBatch) {
        int64_t t[kTokBatch], row[kTokBatch], code[kTokBatch];
#pragma unroll
        for (int i = 0; i < kTokBatch; ++i) t[i] = k + i < k1 ? p.pos_order[k + i] : -1;
#pragma unroll
        for (int i = 0; i < kTokBatch; ++i) {
          row[i] = t[i] >= 0 ? p.dest[t[i]] : -1;
          code[i] = t[i] >= 0 ? p.action_index[t[i]] : -1;
        }
#pragma unroll
        for (int i = 0; i < kTokBatch; ++i) {
          code[i] = code[i] >= 0 ? p.actions[code[i]] & p.action_mask : -1;
        }
        float g[kTokBatch][8];
#pragma unroll
        for (int i = 0; i < kTokBatch; ++i) {
          if (row[i] >= 0) grad_chunk(p, row[i], j, nchunks, sp, g[i]);
        }
#pragma unroll
        for (int i = 0; i < kTokBatch; ++i) {
          if (t[i] >= 0) item_grad(p, t[i], code[i], j, g[i], acc, sacc);
        }
      }
      store8(p.d_pos + w * p.cols + 8 * j, acc);
    }
  }
  float* part = p.partials + group * rows_per_group * p.cols;
  for (int b = 0; b < rows_per_group; ++b) {
    for (int j = threadIdx.x; j < nchunks; j += blockDim.x) {
      float v[8];
      load8(sacc + static_cast<int64_t>(b) * p.cols + 8 * j, v);
      store8(part + static_cast<int64_t>(b) * p.cols + 8 * j, v);
    }
  }
}

}  // namespace lnmd
