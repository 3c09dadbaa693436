// HSTU attention forward for SM90 (H100/H200) with warpgroup MMAs (wgmma): the algorithm of
// hstu_fwd_kernel (fwd_kernel.h) for the training call:
//   per CTA kBlockM = 128 query rows (one 64-row half per warpgroup), walking its key blocks from
//   the highest down:
//     S = Q K^T                  (Q and K read by the tensor cores from shared memory)
//     P = SiLU(alpha S) / scale, masked, converted to Element in registers
//     O += P V                   (P from registers as the A operand, V read MN-major from shared
//                                 memory, the whole head dim per warpgroup)
//   S of key block c is issued together with O += P V of block c - 1, so the SiLU of block c
//   runs while the tensor cores multiply the previous P. K and V stream one block apart (K of
//   c + 1 and V of c load during block c), double-buffered: 192 KB of shared memory.
// Used where the build carries sm_90a code on a 9.0 device, for calls without the relative bias
// and without a cache (q_cu_seqlens, seq_lens, key splits); launch.h picks the SM80 kernel then.
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "bwd_kernel_sm90.h"
#include "kernel_traits.h"
#include "mask.h"
#include "params.h"
#include "utils.h"

namespace hstu {

using namespace cute;

template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_>
struct FwdTraitsSm90 : Sm90Traits<Element_, kHeadDim_, kBlockM_, kBlockN_> {
  using Sm90 = Sm90Traits<Element_, kHeadDim_, kBlockM_, kBlockN_>;
  using typename Sm90::Element;
  using Sm90::kBlockM, Sm90::kBlockN, Sm90::kHeadDim;
  static_assert(kBlockN % 64 == 0 && kHeadDim % 64 == 0 && kHeadDim <= 256);

  using SmemLayoutQ = SmemTileK<Element, kBlockM, kHeadDim>;
  using SmemLayoutKV = SmemTileK<Element, kBlockN, kHeadDim>;
  // V as (head dim, keys): the B operand of P V, MN-major.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));

  using TiledMmaS = GmmaTiled<Element, kBlockN, GMMA::Major::K, GMMA::Major::K, 2, 1>;
  // O += P V with P from registers (the A operand of a register-sourced wgmma).
  using TiledMmaO = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, _16>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  // P's registers as the A operand: the S accumulator ((2 cols, 2 rows, kBlockN / 8 column
  // groups), 1, 1) converted to Element is, register for register, the A fragment
  // ((2 k, 2 rows, 2 k halves), 1, kBlockN / 16 k-blocks) of the 64 x kHeadDim x 16 wgmma.
  using LayoutPRegs = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>,
                             Stride<Stride<_1, _2, _4>, _0, _8>>;

  static constexpr int kSmemQ = int(size(SmemLayoutQ{})) * sizeof(Element);
  static constexpr int kSmemKV = int(size(SmemLayoutKV{})) * sizeof(Element);
  static constexpr int kSmemSize = kSmemQ + 4 * kSmemKV;
};

template <typename T, int D>
struct FwdConfigSm90 {
  static constexpr bool kEnabled = false;
};
template <typename T>
struct FwdConfigSm90<T, 256> {
  static constexpr bool kEnabled = true;
  using type = FwdTraitsSm90<T, 256, 128, 64>;  // 192 KB
};

// Issues acc (+)= A B with A from registers (tCrA) over all k-slices as one wgmma batch.
template <bool kZero, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void gmma_issue_rs(TiledMma& mma, FragA& tCrA, FragB const& tCrB,
                                              Acc& acc) {
  warpgroup_fence_operand(tCrA);
  gmma_issue<kZero>(mma, tCrA, tCrB, acc);
  warpgroup_fence_operand(tCrA);
}

template <typename Kt>
__global__ void __launch_bounds__(256, 1) hstu_fwd_kernel_sm90(const __grid_constant__ HstuParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  extern __shared__ __align__(1024) char smem_[];

  // Grid order as hstu_fwd_kernel: block 0 first, then the last block down to block 1.
  const int n_m_blocks = (p.max_seqlen + kBlockM - 1) / kBlockM;
  int order, bidb, bidh;
  if (!cta_tile(p, n_m_blocks, order, bidb, bidh)) return;
  const int m_block = fwd_block_of_order(order, n_m_blocks);
  const int tidx = threadIdx.x;
  const int seq_start = p.cu_seqlens[bidb];
  const int L = p.cu_seqlens[bidb + 1] - seq_start;
  const int m0 = m_block * kBlockM;
  if (m0 >= L) return;
  const SeqMask mk = make_seq_mask(p, bidb, L);
  const int m1 = min(m0 + kBlockM, L);
  const int n_lo = mk.row_block_key_lo(m0) / kBlockN;
  const int n_hi = (mk.row_block_key_hi(m0, m1) + kBlockN - 1) / kBlockN;
  // The next non-empty key block below n (n_lo - 1 or less: none).
  auto below = [&](int n) {
    --n;
    while (n >= n_lo && mk.tile_empty(m0, m1, n * kBlockN, (n + 1) * kBlockN)) --n;
    return n;
  };

  const int64_t base = int64_t(seq_start) * p.row_stride + int64_t(bidh) * p.head_stride;
  const Element* q_ptr = reinterpret_cast<const Element*>(p.q) + base;
  const Element* k_ptr = reinterpret_cast<const Element*>(p.k) + base;
  const Element* v_ptr = reinterpret_cast<const Element*>(p.v) + base;
  Element* o_ptr = reinterpret_cast<Element*>(p.o) + base;
  auto row_tile = [&](auto* ptr, int row0, auto rows) {
    return make_tensor(make_gmem_ptr(ptr + int64_t(row0) * p.row_stride),
                       make_shape(rows, Int<kHeadDim>{}), make_stride(p.row_stride, _1{}));
  };

  constexpr int kKVElems = Kt::kSmemKV / int(sizeof(Element));
  Element* smem_q = reinterpret_cast<Element*>(smem_);
  Element* smem_k = smem_q + Kt::kSmemQ / sizeof(Element);  // 2 stages
  Element* smem_v = smem_k + 2 * kKVElems;                   // 2 stages
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  auto sK = [&](int stage) {
    return make_tensor(make_smem_ptr(smem_k + stage * kKVElems), typename Kt::SmemLayoutKV{});
  };
  auto sV = [&](int stage) {
    return make_tensor(make_smem_ptr(smem_v + stage * kKVElems), typename Kt::SmemLayoutKV{});
  };
  auto sVt = [&](int stage) {
    return make_tensor(make_smem_ptr(smem_v + stage * kKVElems), typename Kt::SmemLayoutVt{});
  };

  typename Kt::GmemTiledCopyLoad gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV =
      gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  auto load_rows = [&](const Element* ptr, auto const& dst_tile, int n) {
    Tensor dst = gmem_thr_copy.partition_D(dst_tile);
    Tensor src = gmem_thr_copy.partition_S(row_tile(ptr, n * kBlockN, Int<kBlockN>{}));
    copy_rows_zfill(gmem_tiled_copy, src, dst, tKVcKV, L - n * kBlockN);
  };

  typename Kt::TiledMmaS mma_s;
  auto thr_s = mma_s.get_thread_slice(tidx);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK0 = thr_s.partition_fragment_B(sK(0));
  Tensor tSrK1 = thr_s.partition_fragment_B(sK(1));
  typename Kt::TiledMmaO mma_o;
  auto thr_o = mma_o.get_thread_slice(tidx);
  Tensor tOrVt0 = thr_o.partition_fragment_B(sVt(0));
  Tensor tOrVt1 = thr_o.partition_fragment_B(sVt(1));
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor tOrP = make_tensor<Element>(typename Kt::LayoutPRegs{});
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

  const float half_alpha = 0.5f * p.alpha;
  const float inv_scale = p.inv_scale_ptr ? *p.inv_scale_ptr : p.inv_scale;
  const float half_alpha_scale = 0.5f * p.alpha * inv_scale;
  // SiLU and the mask of key block n0's S, in place.
  auto silu_mask = [&](auto& acc_s, int n0) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) {
      acc_s(i) = silu_scaled(acc_s(i), half_alpha, half_alpha_scale);
    }
    if (!mk.tile_full(m0, m1, n0, n0 + kBlockN)) apply_mask_gmma(mk, tScS, m0, n0, acc_s);
  };
  auto to_p = [&](auto const& acc_s) {
    Tensor rP = convert_fragment<Element>(acc_s);
    CUTE_UNROLL
    for (int i = 0; i < size(rP); ++i) tOrP(i) = rP(i);
  };

  // Key block c (c = 0, 1, ... from the highest down) uses K stage c % 2 and V stage c % 2.
  // While S of block c and O += P V of block c - 1 run, K of block c + 1 and V of block c load.
  int n_block = below(n_hi);
  if (n_block >= n_lo) {  // (every non-empty row block has a key block)
    {
      Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
      copy_rows_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(row_tile(q_ptr, m0, Int<kBlockM>{})),
                      tQsQ, tQcQ, L - m0);
    }
    load_rows(k_ptr, sK(0), n_block);
    cute::cp_async_fence();
    int next = below(n_block);
    if (next >= n_lo) load_rows(k_ptr, sK(1), next);
    load_rows(v_ptr, sV(0), n_block);
    cute::cp_async_fence();
    cute::cp_async_wait<1>();
    fence_async_shared();
    __syncthreads();  // Q and K of block 0 visible
    {
      Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
      gmma_issue<true>(mma_s, tSrQ, tSrK0, acc_s);
      gmma_wait<0>(acc_s);
      silu_mask(acc_s, n_block * kBlockN);
      to_p(acc_s);
    }
    int stage = 1;  // the stage of block c = 1
    n_block = next;
    while (n_block >= n_lo) {
      const int n0 = n_block * kBlockN;
      next = below(n_block);
      cute::cp_async_wait<0>();
      fence_async_shared();
      // K of this block and V of the previous one visible; block c - 1's GEMMs (which read
      // K stage c - 1 and V stage c - 2, the two stages loaded next) are done.
      __syncthreads();
      if (next >= n_lo) load_rows(k_ptr, sK(stage ^ 1), next);
      load_rows(v_ptr, sV(stage), n_block);
      cute::cp_async_fence();
      Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
      gmma_issue<true>(mma_s, tSrQ, stage ? tSrK1 : tSrK0, acc_s);
      gmma_issue_rs<false>(mma_o, tOrP, stage ? tOrVt0 : tOrVt1, acc_o);
      gmma_wait<1>(acc_s);
      silu_mask(acc_s, n0);  // while the tensor cores run the previous block's P V
      gmma_wait<0>(acc_o);
      to_p(acc_s);  // the previous P's registers are free once its GEMM is done
      stage ^= 1;
      n_block = next;
    }
    // The last block's O += P V (its V is in stage ^ 1).
    cute::cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();
    gmma_issue_rs<false>(mma_o, tOrP, stage ? tOrVt0 : tOrVt1, acc_o);
    gmma_wait<0>(acc_o);
  }

  // Epilogue: registers -> shared (reusing sQ) -> 16-byte global stores.
  Tensor rO = convert_fragment<Element>(acc_o);
  auto copy_O = make_tiled_copy_C(typename Kt::SmemCopyAtomR2S{}, mma_o);
  auto thr_copy_O = copy_O.get_thread_slice(tidx);
  cute::cp_async_wait<0>();
  __syncthreads();
  Tensor tOsO_w = thr_copy_O.partition_D(sQ);
  copy(copy_O, thr_copy_O.retile_S(rO), tOsO_w);
  __syncthreads();
  typename Kt::GmemTiledCopyStore gmem_tiled_copy_O;
  auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_copy_O.partition_S(sQ);
  Tensor tOgO = gmem_thr_copy_O.partition_D(row_tile(o_ptr, m0, Int<kBlockM>{}));
  copy_rows_store(gmem_tiled_copy_O, tOsO, tOgO, tQcQ, L - m0);
#endif
}

}  // namespace hstu
