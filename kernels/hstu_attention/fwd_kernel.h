// HSTU attention forward: one CTA per (query block, sequence, head); K/V blocks stream through
// shared memory (cp.async: V(n) lands while Q K(n)^T runs, K(next) while P V(n) runs).
//   S = Q K^T (fp32), P = SiLU(alpha S) / scaling_seqlen masked, O += P V; no softmax, so no
//   running max/sum and no rescaling of O.
#pragma once

#include <cute/tensor.hpp>

#include "bias.h"
#include "kernel_traits.h"
#include "mask.h"
#include "params.h"
#include "utils.h"

namespace hstu {

using namespace cute;

__device__ __forceinline__ SeqMask make_seq_mask(HstuParams const& p, int bidb, int L) {
  SeqMask mk;
  mk.L = L;
  mk.c = p.num_contexts ? p.num_contexts[bidb] : 0;
  const int t = p.num_targets ? p.num_targets[bidb] : 0;
  mk.H = L - t;
  mk.G = p.target_group_size;
  mk.w = p.window_size;
  mk.causal = p.causal;
  return mk;
}

// kBias: add the relative attention bias (bias.h) to every score tile.
template <typename Kt, bool kBias>
__global__ void __launch_bounds__(Kt::kNWarps * 32, 1)
    hstu_fwd_kernel(const __grid_constant__ HstuParams p) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  extern __shared__ __align__(1024) char smem_[];

  // 1-D grid over (query block, sequence, head) in dispatch groups of (sequence, head) pairs
  // (grid_tile_of); inside a group CTAs go heaviest first: block 0 (it holds the contextual rows,
  // which see the whole history), then the last block down to block 1 (causal work shrinks
  // with m).
  const int n_m_blocks =
      ((p.q_cu_seqlens ? p.max_q_seqlen : p.max_seqlen) + kBlockM - 1) / kBlockM;
  int order, bidb, bidh;
  if (!cta_tile(p, n_m_blocks, order, bidb, bidh)) return;
  const int m_block = fwd_block_of_order(order, n_m_blocks);
  const int tidx = threadIdx.x;
  const int seq_start = p.cu_seqlens[bidb];
  const int L = p.seq_lens ? p.seq_lens[bidb] : p.cu_seqlens[bidb + 1] - seq_start;
  // q/o rows: the sequence's own (training) or, against a cache, its last Lq positions; m0 and
  // m1 are positions in the sequence (masks, bias), q_row0 the tile's first row of q/o.
  int q_start = seq_start, q_shift = 0;
  if (p.q_cu_seqlens) {
    q_start = p.q_cu_seqlens[bidb];
    q_shift = L - (p.q_cu_seqlens[bidb + 1] - q_start);
  }
  const int m0 = q_shift + m_block * kBlockM;
  const int q_row0 = m_block * kBlockM;
  if (m0 >= L) return;
  const SeqMask mk = make_seq_mask(p, bidb, L);
  const int m1 = min(m0 + kBlockM, L);
  int n_lo = mk.row_block_key_lo(m0) / kBlockN;
  const int n_hi = (mk.row_block_key_hi(m0, m1) + kBlockN - 1) / kBlockN;
  auto empty = [&](int n) { return mk.tile_empty(m0, m1, n * kBlockN, (n + 1) * kBlockN); };
  int n_block = n_hi - 1;
  while (n_block >= n_lo && empty(n_block)) --n_block;
  if (p.num_splits > 1) {
    // this CTA's share of the key blocks: split blockIdx.y takes the chunk that starts
    // blockIdx.y chunks below the highest non-empty block (o_accum is zeroed: an empty share
    // adds nothing)
    const int blocks = n_block - n_lo + 1;
    if (blocks <= 0) return;
    const int chunk = (blocks + p.num_splits - 1) / p.num_splits;
    const int top = n_block - int(blockIdx.y) * chunk;
    const int bottom = max(n_lo, top - chunk + 1);
    if (top < bottom) return;
    n_block = top;
    n_lo = bottom;
    while (n_block >= n_lo && empty(n_block)) --n_block;
    if (n_block < n_lo) return;
  }

  const int64_t base = int64_t(seq_start) * p.row_stride + int64_t(bidh) * p.head_stride;
  const int64_t q_base = int64_t(q_start) * p.row_stride + int64_t(bidh) * p.head_stride;
  const Element* q_ptr = reinterpret_cast<const Element*>(p.q) + q_base;
  const Element* k_ptr = reinterpret_cast<const Element*>(p.k) + base;
  const Element* v_ptr = reinterpret_cast<const Element*>(p.v) + base;
  Element* o_ptr = reinterpret_cast<Element*>(p.o) + q_base;
  auto row_tile = [&](const Element* ptr, int row0, auto rows) {
    return make_tensor(make_gmem_ptr(ptr + int64_t(row0) * p.row_stride),
                       make_shape(rows, Int<kHeadDim>{}), make_stride(p.row_stride, _1{}));
  };
  Tensor gQ = row_tile(q_ptr, q_row0, Int<kBlockM>{});

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_)),
                          typename Kt::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Kt::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Kt::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Kt::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Kt::SmemLayoutVtNoSwizzle{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename Kt::SmemLayoutP{});  // kPSmem only

  typename Kt::GmemTiledCopyLoad gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV =
      gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  auto load_kv = [&](const Element* ptr, auto& dst, int n) {
    Tensor g = row_tile(ptr, n * kBlockN, Int<kBlockN>{});
    Tensor src = gmem_thr_copy.partition_S(g);
    copy_rows_zfill(gmem_tiled_copy, src, dst, tKVcKV, L - n * kBlockN);
  };

  typename Kt::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);

  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_K.partition_S(sK);
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, tiled_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);

  // kPSmem: P goes registers -> sP, then sP -> registers as the A operand of P V.
  auto smem_tiled_copy_Pw = make_tiled_copy_C(typename Kt::SmemCopyAtomR2S{}, tiled_mma);
  auto smem_thr_copy_Pw = smem_tiled_copy_Pw.get_thread_slice(tidx);
  Tensor tPsP = smem_thr_copy_Pw.partition_D(sP);
  auto smem_tiled_copy_P = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_P = smem_tiled_copy_P.get_thread_slice(tidx);
  Tensor tOsP = smem_thr_copy_P.partition_S(sP);
  Tensor tOrPs = thr_mma.partition_fragment_A(sP);

  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

  copy_rows_zfill(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, L - m0);
  if (n_block >= n_lo) load_kv(k_ptr, tKsK, n_block);
  cute::cp_async_fence();

  // Relative bias (bias.h): tables past the tiles in shared memory; tile t reads buffer t % 2,
  // and the next tile's buffer is filled after the barrier that ends tile t's SiLU phase.
  [[maybe_unused]] const auto bt = bias_tables<kBlockM, kBlockN, false>(p, smem_ + Kt::kSmemSize);
  int tile_buf = 0;
  if constexpr (kBias) {  // covered by the loop's first barrier
    load_bias_constants<Kt::kNThreads>(p, bidh, bt, tidx, false);
    fill_query_times<kBlockM, Kt::kNThreads>(p, bt, 0, bidb, seq_start, L, m0, tidx);
    if (n_block >= n_lo) {
      fill_diagonals<kBlockM, kBlockN, Kt::kNThreads>(p, bidh, bt, 0, m0, n_block * kBlockN, tidx);
      fill_key_timestamps<kBlockN, Kt::kNThreads>(p, bt, 0, seq_start, L, n_block * kBlockN, tidx);
    }
  }
  const float half_alpha = 0.5f * p.alpha;
  const float inv_scale = p.inv_scale_ptr ? *p.inv_scale_ptr : p.inv_scale;
  const float half_alpha_scale = 0.5f * p.alpha * inv_scale;
  while (n_block >= n_lo) {
    const int n0 = n_block * kBlockN;
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    if constexpr (!kBias) clear(acc_s);
    cute::cp_async_wait<0>();
    __syncthreads();
    load_kv(v_ptr, tVsV, n_block);
    cute::cp_async_fence();
    // With a bias, the score GEMM accumulates onto it (its tables were filled before the
    // barrier above): one add per element less, and the bias does not wait for the GEMM.
    if constexpr (kBias) add_rel_bias<kBlockM, true>(bt, tile_buf, tile_buf, 0, tScS, acc_s);
    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
            smem_thr_copy_Q, smem_thr_copy_K);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) {
      acc_s(i) = silu_scaled(acc_s(i), half_alpha, half_alpha_scale);
    }
    if (!mk.tile_full(m0, m1, n0, n0 + kBlockN)) apply_mask(mk, tScS, m0, n0, acc_s);
    Tensor rP = convert_fragment<Element>(acc_s);
    // sP is free: every warp passed this iteration's first barrier after the preceding P V.
    if constexpr (Kt::kPSmem) copy(smem_tiled_copy_Pw, smem_thr_copy_Pw.retile_S(rP), tPsP);
    cute::cp_async_wait<0>();
    __syncthreads();  // V landed; every warp is done reading sK (and, kPSmem, wrote its P)
    int next = n_block - 1;
    while (next >= n_lo && empty(next)) --next;
    if (next >= n_lo) {
      load_kv(k_ptr, tKsK, next);
      cute::cp_async_fence();
      if constexpr (kBias) {
        fill_diagonals<kBlockM, kBlockN, Kt::kNThreads>(p, bidh, bt, tile_buf ^ 1, m0,
                                                        next * kBlockN, tidx);
        fill_key_timestamps<kBlockN, Kt::kNThreads>(p, bt, tile_buf ^ 1, seq_start, L,
                                                    next * kBlockN, tidx);
      }
    }
    tile_buf ^= 1;
    if constexpr (Kt::kPSmem) {
      gemm_ss_lean(acc_o, tOrPs, tOrVt, tOsP, tOsVt, tiled_mma, smem_tiled_copy_P,
                   smem_tiled_copy_V, smem_thr_copy_P, smem_thr_copy_V);
    } else {
      Tensor tOrP = make_tensor(rP.data(), acc_layout_as_A(rP.layout()));
      gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);
    }
    n_block = next;
  }

  if (p.num_splits > 1) {  // a partial output: fp32 adds into o_accum, rows of the sequence only
    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    float* acc_ptr = p.o_accum + q_base + int64_t(q_row0) * p.row_stride;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_o); ++i) {
      const int r = get<0>(tOcO(i));
      if (m0 + r < L) atomicAdd(acc_ptr + int64_t(r) * p.row_stride + get<1>(tOcO(i)), acc_o(i));
    }
    cute::cp_async_wait<0>();
    return;
  }

  // Epilogue: registers -> shared (reusing sQ) -> 16-byte global stores.
  Tensor rO = convert_fragment<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename Kt::SmemLayoutQ{});
  auto smem_tiled_copy_O = make_tiled_copy_C(typename Kt::SmemCopyAtomR2S{}, tiled_mma);
  auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_copy_O.retile_S(rO);
  Tensor taccOsO = smem_thr_copy_O.partition_D(sO);
  cute::cp_async_wait<0>();
  __syncthreads();
  copy(smem_tiled_copy_O, taccOrO, taccOsO);
  __syncthreads();
  Tensor gO = make_tensor(make_gmem_ptr(o_ptr + int64_t(q_row0) * p.row_stride),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_stride(p.row_stride, _1{}));
  typename Kt::GmemTiledCopyStore gmem_tiled_copy_O;
  auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_copy_O.partition_S(sO);
  Tensor tOgO = gmem_thr_copy_O.partition_D(gO);
  copy_rows_store(gmem_tiled_copy_O, tOsO, tOgO, tQcQ, L - m0);
}

}  // namespace hstu
