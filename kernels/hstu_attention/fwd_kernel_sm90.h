// HSTU attention forward for SM90 (H100/H200) with warpgroup MMAs (wgmma): the algorithm of
// hstu_fwd_kernel (fwd_kernel.h) for the training call, with both GEMMs read by the tensor cores
// straight from shared memory:
//   per CTA kBlockM = 128 query rows (one 64-row half per warpgroup), walking its key blocks from
//   the highest down (K/V double-buffered: the next block streams in during this one):
//     S = Q K^T                         (asynchronous, waited)
//     P = SiLU(alpha S) / scale, masked -> shared memory as Element (each warpgroup its rows)
//     O += P V                          (V read MN-major, the whole head dim per warpgroup)
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
  using SmemLayoutP = SmemTileK<Element, kBlockM, kBlockN>;

  using TiledMmaS = GmmaTiled<Element, kBlockN, GMMA::Major::K, GMMA::Major::K, 2, 1>;
  using TiledMmaO = GmmaTiled<Element, kHeadDim, GMMA::Major::K, GMMA::Major::MN, 2, 1>;

  static constexpr int kSmemQ = int(size(SmemLayoutQ{})) * sizeof(Element);
  static constexpr int kSmemKV = int(size(SmemLayoutKV{})) * sizeof(Element);
  static constexpr int kSmemP = int(size(SmemLayoutP{})) * sizeof(Element);
  static constexpr int kSmemSize = kSmemQ + 4 * kSmemKV + kSmemP;
};

template <typename T, int D>
struct FwdConfigSm90 {
  static constexpr bool kEnabled = false;
};
template <typename T>
struct FwdConfigSm90<T, 256> {
  static constexpr bool kEnabled = true;
  using type = FwdTraitsSm90<T, 256, 128, 64>;  // 208 KB
};

// Barrier of one warpgroup's 128 threads (ids 1 and 2; 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory");
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
  Element* smem_p = smem_v + 2 * kKVElems;
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Kt::SmemLayoutP{});
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
  auto load_kv = [&](int n, int stage) {
    load_rows(k_ptr, sK(stage), n);
    load_rows(v_ptr, sV(stage), n);
  };

  typename Kt::TiledMmaS mma_s;
  auto thr_s = mma_s.get_thread_slice(tidx);
  Tensor tSrQ = thr_s.partition_fragment_A(sQ);
  Tensor tSrK0 = thr_s.partition_fragment_B(sK(0));
  Tensor tSrK1 = thr_s.partition_fragment_B(sK(1));
  typename Kt::TiledMmaO mma_o;
  auto thr_o = mma_o.get_thread_slice(tidx);
  Tensor tOrP = thr_o.partition_fragment_A(sP);
  Tensor tOrVt0 = thr_o.partition_fragment_B(sVt(0));
  Tensor tOrVt1 = thr_o.partition_fragment_B(sVt(1));
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);

  auto copy_P = make_tiled_copy_C(typename Kt::SmemCopyAtomR2S{}, mma_s);
  auto thr_copy_P = copy_P.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_P.partition_D(sP);
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

  int n_block = below(n_hi);
  {
    Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
    copy_rows_zfill(gmem_tiled_copy, gmem_thr_copy.partition_S(row_tile(q_ptr, m0, Int<kBlockM>{})),
                    tQsQ, tQcQ, L - m0);
  }
  if (n_block >= n_lo) load_kv(n_block, 0);
  cute::cp_async_fence();

  const float half_alpha = 0.5f * p.alpha;
  const float inv_scale = p.inv_scale_ptr ? *p.inv_scale_ptr : p.inv_scale;
  const float half_alpha_scale = 0.5f * p.alpha * inv_scale;
  const int wg = tidx / 128;
  int stage = 0;
  while (n_block >= n_lo) {
    const int n0 = n_block * kBlockN;
    const int next = below(n_block);
    cute::cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // this block's K/V (and Q) visible; every GEMM of the last block is done
    if (next >= n_lo) load_kv(next, stage ^ 1);
    cute::cp_async_fence();
    Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    gmma_issue<true>(mma_s, tSrQ, stage ? tSrK1 : tSrK0, acc_s);
    gmma_wait<0>(acc_s);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) {
      acc_s(i) = silu_scaled(acc_s(i), half_alpha, half_alpha_scale);
    }
    if (!mk.tile_full(m0, m1, n0, n0 + kBlockN)) apply_mask_gmma(mk, tScS, m0, n0, acc_s);
    Tensor rP = convert_fragment<Element>(acc_s);
    copy(copy_P, thr_copy_P.retile_S(rP), tPsP);
    fence_async_shared();
    warpgroup_barrier(wg);  // the warpgroup's P rows written (the other's are its own)
    gmma_issue<false>(mma_o, tOrP, stage ? tOrVt1 : tOrVt0, acc_o);
    gmma_wait<0>(acc_o);
    stage ^= 1;
    n_block = next;
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
