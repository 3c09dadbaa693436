// HSTU attention backward for SM90 (H100/H200) with warpgroup MMAs (wgmma): the same algorithm
// and dP-first schedule as hstu_bwd_kernel (bwd_kernel.h), with every GEMM read by the tensor
// cores straight from shared memory instead of through ldmatrix and registers:
//   per query block of kBlockM rows (one 64-row half per warpgroup for S, dP and dQ):
//     dP = dO V^T, S = Q K^T            (issued back to back, asynchronous)
//     P, dS (SiLU and its derivative, masked) -> shared memory as Element
//     dV += P^T dO, dK += dS^T Q        (each warpgroup owns half of the head dim's columns)
//     dQ = dS K                          (kDQChunks column chunks, fp32 reductions into dq_accum)
// Loads stay cp.async (single-buffered Q/dO: the next dO streams in once dV has read it, the next
// Q once dK has), made visible to the tensor cores' async proxy by a proxy fence. Used where the
// build carries sm_90a code (HSTU_CUDA_ARCH_LIST "9.0a") on a 9.0 device, without the relative
// bias, deterministic mode or the in-kernel dQ conversion (launch.h picks the SM80 kernel then).
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>

#include "bwd_kernel.h"
#include "kernel_traits.h"
#include "mask.h"
#include "params.h"
#include "utils.h"

namespace hstu {

using namespace cute;

// A warpgroup MMA tiled over a kWgM x kWgN grid of warpgroups, each doing 64 x N x 16
// (fp32 accumulators, operands read from shared memory with the given majors).
template <typename Element, int N, GMMA::Major kMajorA, GMMA::Major kMajorB, int kWgM, int kWgN>
using GmmaTiled = decltype(make_tiled_mma(
    GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<N>, _16>, kMajorA, kMajorB>(),
    Layout<Shape<Int<kWgM>, Int<kWgN>, _1>>{}));

// A [rows x cols] shared tile, cols contiguous: the GMMA canonical 128-byte-swizzle K-major layout.
template <typename Element, int kRows, int kCols>
using SmemTileK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                         Shape<Int<kRows>, Int<kCols>>{}));

// What the SM90 forward and backward tiles share: kBlockM = 128 query rows, one 64-row half
// per warpgroup (2 warpgroups, 256 threads), kBlockN keys, head dim kHeadDim.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_>
struct Sm90Traits : BaseTraits<Element_, kHeadDim_, 256> {
  using Base = BaseTraits<Element_, kHeadDim_, 256>;
  using Element = typename Base::Element;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = 256;
  static_assert(kBlockM == 128, "one 64-row half of the query block per warpgroup");
};

// Tiles of the SM90 backward: kBlockM query rows (2 warpgroups x 64) x kBlockN keys, Q/dO
// single-buffered. Every shared tile is a GMMA canonical 128-byte-swizzle K-major layout (the
// same bytes as SmemAtom<64>'s), read transposed (MN-major) where a GEMM needs it so.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kDQChunks_>
struct BwdTraitsSm90 : Sm90Traits<Element_, kHeadDim_, kBlockM_, kBlockN_> {
  using Sm90 = Sm90Traits<Element_, kHeadDim_, kBlockM_, kBlockN_>;
  using typename Sm90::Element;
  using Sm90::kBlockM, Sm90::kBlockN, Sm90::kHeadDim;
  static constexpr int kDQChunks = kDQChunks_;
  static constexpr int kDQCols = kHeadDim / kDQChunks;
  static_assert(kBlockN == 64 && kHeadDim % 128 == 0 && kDQCols % 64 == 0);

  using SmemLayoutQdO = SmemTileK<Element, kBlockM, kHeadDim>;
  using SmemLayoutKV = SmemTileK<Element, kBlockN, kHeadDim>;
  using SmemLayoutPdS = SmemTileK<Element, kBlockM, kBlockN>;
  // Transposed views: (head dim, query rows) of Q/dO, (keys, query rows) of P/dS, (head dim,
  // keys) of K.
  using SmemLayoutQdOt = decltype(composition(
      SmemLayoutQdO{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));

  // S, dP = [kBlockM x kBlockN]: warpgroup w takes rows 64w..; A (Q, dO) and B (K, V) K-major.
  using TiledMmaSdP = GmmaTiled<Element, kBlockN, GMMA::Major::K, GMMA::Major::K, 2, 1>;
  // dV, dK = [kBlockN x D] over the kBlockM query rows: warpgroup w takes columns w D/2..;
  // A = P^T / dS^T and B = dO^T / Q^T are read MN-major.
  using TiledMmadKV = GmmaTiled<Element, kHeadDim / 2, GMMA::Major::MN, GMMA::Major::MN, 1, 2>;
  // dQ chunk = [kBlockM x kDQCols] over the kBlockN keys: warpgroup w takes rows 64w..;
  // A = dS K-major, B = K^T MN-major.
  using TiledMmadQ = GmmaTiled<Element, kDQCols, GMMA::Major::K, GMMA::Major::MN, 2, 1>;

  static constexpr int kSmemQdO = int(size(SmemLayoutQdO{})) * sizeof(Element);
  static constexpr int kSmemKV = int(size(SmemLayoutKV{})) * sizeof(Element);
  static constexpr int kSmemPdS = int(size(SmemLayoutPdS{})) * sizeof(Element);
  static constexpr int kSmemSize = 2 * kSmemQdO + 2 * kSmemKV + 2 * kSmemPdS;
};

// The SM90 tiles per (dtype, head dim); kEnabled false: the SM80 kernel. d128 (the same tiles
// with one 128-column dQ chunk) measured 12% slower than the SM80 d128 backward on the H100
// (long_d128 1.98 vs 1.77 ms): there the SM80 kernel's 64-row tiles with 128 keys halve the
// Q/dO loads and dQ reductions per MAC, which 64-key wgmma tiles cannot match in registers.
template <typename T, int D>
struct BwdConfigSm90 {
  static constexpr bool kEnabled = false;
};
template <typename T>
struct BwdConfigSm90<T, 256> {
  static constexpr bool kEnabled = true;
  using type = BwdTraitsSm90<T, 256, 128, 64, 2>;  // 224 KB
};

// Makes the threads' shared-memory writes (st.shared, cp.async) visible to the tensor cores'
// async proxy; a barrier must follow before another warpgroup's wgmma reads them.
__device__ __forceinline__ void fence_async_shared() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Issues acc (+)= A B over all k-slices as one wgmma batch (not waited for).
template <bool kZero, class TiledMma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void gmma_issue(TiledMma& mma, FragA const& tCrA, FragB const& tCrB,
                                           Acc& acc) {
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  if constexpr (kZero) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(acc);
}

// Waits until at most N wgmma batches of this warpgroup are in flight.
template <int N, class... Accs>
__device__ __forceinline__ void gmma_wait(Accs&... accs) {
  warpgroup_wait<N>();
  (warpgroup_fence_operand(accs), ...);
}

// A GMMA accumulator of one 64 x N warpgroup tile holds ((2 columns, 2 rows, N / 8 column
// groups), 1, 1) per thread; tScS gives each element's (row, col) in the CTA tile.
template <class Mask, class CoordT, class... Accs>
__device__ __forceinline__ void apply_mask_gmma(Mask const& mk, CoordT const& tScS, int m0, int n0,
                                                Accs&... accs) {
  auto& acc0 = (accs, ...);
  static_assert(decltype(size<1>(acc0))::value == 1 && decltype(size<2>(acc0))::value == 1);
  constexpr int kGroups = decltype(size<0, 2>(acc0))::value;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    int lo1, hi1, lo2, hi2;
    mk.row_keys(m0 + get<0>(tScS(make_coord(0, r, 0), 0, 0)), lo1, hi1, lo2, hi2);
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      CUTE_UNROLL
      for (int cc = 0; cc < 2; ++cc) {
        const int j = n0 + get<1>(tScS(make_coord(cc, r, g), 0, 0));
        if (!((j >= lo1 && j < hi1) || (j >= lo2 && j < hi2))) {
          ((accs(make_coord(cc, r, g), 0, 0) = 0.f), ...);
        }
      }
    }
  }
}

template <typename Kt>
__global__ void __launch_bounds__(256, 1) hstu_bwd_kernel_sm90(const __grid_constant__ HstuParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  constexpr int kDQCols = Kt::kDQCols;
  extern __shared__ __align__(1024) char smem_[];

  int n_block, bidb, bidh, tidx, seq_start, L, n0;
  if (!locate_key_block<kBlockN>(p, n_block, bidb, bidh, tidx, seq_start, L, n0)) return;
  const SeqMask mk = make_seq_mask(p, bidb, L);
  const int n1 = min(n0 + kBlockN, L);
  int m_lo, m_hi;
  mk.key_block_query_blocks(n0, n1, kBlockM, m_lo, m_hi);
  auto next_active = [&](int m) {
    ++m;
    while (m < m_hi && mk.tile_empty(m * kBlockM, (m + 1) * kBlockM, n0, n1)) ++m;
    return m;
  };

  const BwdRows<Element, kHeadDim> g(p, seq_start, bidh);

  Element* smem_q = reinterpret_cast<Element*>(smem_);
  Element* smem_do = smem_q + Kt::kSmemQdO / sizeof(Element);
  Element* smem_k = smem_do + Kt::kSmemQdO / sizeof(Element);
  Element* smem_v = smem_k + Kt::kSmemKV / sizeof(Element);
  Element* smem_p = smem_v + Kt::kSmemKV / sizeof(Element);
  Element* smem_ds = smem_p + Kt::kSmemPdS / sizeof(Element);
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQdO{});
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQdOt{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), typename Kt::SmemLayoutQdO{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename Kt::SmemLayoutQdOt{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKt{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Kt::SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Kt::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Kt::SmemLayoutPdSt{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Kt::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Kt::SmemLayoutPdSt{});

  // Global -> shared.
  typename Kt::GmemTiledCopyLoad gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV =
      gmem_thr_copy.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  auto load_rows = [&](const Element* ptr, auto& dst, int m) {
    Tensor src = gmem_thr_copy.partition_S(g.tile(ptr, m * kBlockM, Int<kBlockM>{}));
    copy_rows_zfill(gmem_tiled_copy, src, dst, tQcQ, L - m * kBlockM);
  };

  // MMAs: descriptors of the shared tiles.
  typename Kt::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  typename Kt::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdSt);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
  typename Kt::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);

  // Accumulators -> shared (P, dS; at the end dK, dV).
  auto copy_PdS = make_tiled_copy_C(typename Kt::SmemCopyAtomR2S{}, mma_sdp);
  auto thr_copy_PdS = copy_PdS.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_PdS.partition_D(sP);
  Tensor tdSsdS = thr_copy_PdS.partition_D(sdS);

  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kDQCols>>{}));

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // dQ chunk c = dS K[:, c kDQCols ..], issued (not waited for).
  auto dq_issue = [&](auto& acc, int chunk) {
    Tensor sKtc = local_tile(sKt, Shape<Int<kDQCols>, Int<kBlockN>>{}, make_coord(chunk, 0));
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKtc);
    gmma_issue<true>(mma_dq, tdQrdS, tdQrKt, acc);
  };
  // Fire-and-forget fp32 reductions of a finished dQ chunk (rows past the sequence skipped).
  auto dq_reduce = [&](auto const& acc, int m0, int chunk) {
    const int rows = L - m0;
    Tensor gdQacc = make_tensor(make_gmem_ptr(g.dqacc + int64_t(m0) * kHeadDim + chunk * kDQCols),
                                Shape<Int<kBlockM>, Int<kDQCols>>{}, Stride<Int<kHeadDim>, _1>{});
    Tensor tdQgdQacc = thr_dq.partition_C(gdQacc);
    constexpr int kGroups = decltype(size<0, 2>(acc))::value;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      if (get<0>(tdQcdQ(make_coord(0, r, 0), 0, 0)) < rows) {
        CUTE_UNROLL
        for (int g = 0; g < kGroups; ++g) {
          red_add_f32x2(&tdQgdQacc(make_coord(0, r, g), 0, 0), acc(make_coord(0, r, g), 0, 0),
                        acc(make_coord(1, r, g), 0, 0));
        }
      }
    }
  };

  // P and the dS factor of each score (SiluBwd, utils.h).
  const float half_alpha = 0.5f * p.alpha;
  const float inv_scale = p.inv_scale_ptr ? *p.inv_scale_ptr : p.inv_scale;
  const SiluBwd silu{half_alpha, inv_scale, 0.5f * p.alpha * inv_scale};

  int m_block = m_lo;
  if (m_block < m_hi && mk.tile_empty(m_block * kBlockM, (m_block + 1) * kBlockM, n0, n1)) {
    m_block = next_active(m_block);
  }
  {
    Tensor gk = gmem_thr_copy.partition_S(g.tile(g.k, n0, Int<kBlockN>{}));
    Tensor gv = gmem_thr_copy.partition_S(g.tile(g.v, n0, Int<kBlockN>{}));
    copy_rows_zfill(gmem_tiled_copy, gk, tKsK, tKVcKV, L - n0);
    copy_rows_zfill(gmem_tiled_copy, gv, tVsV, tKVcKV, L - n0);
  }
  // Two cp.async groups in flight across iterations: dO (with K, V the first time), then Q.
  if (m_block < m_hi) load_rows(g.dout, tdOsdO, m_block);
  cute::cp_async_fence();
  if (m_block < m_hi) load_rows(g.q, tQsQ, m_block);
  cute::cp_async_fence();
  while (m_block < m_hi) {
    const int m0 = m_block * kBlockM;
    const int next = next_active(m_block);
    cute::cp_async_wait<1>();
    fence_async_shared();
    __syncthreads();  // dO, K, V visible to both warpgroups' wgmma
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    gmma_issue<true>(mma_sdp, tdPrdO, tdPrV, acc_dp);
    cute::cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();  // Q visible
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    gmma_issue<true>(mma_sdp, tSrQ, tSrK, acc_s);
    gmma_wait<0>(acc_dp, acc_s);
    // Masked elements: s = 0 gives P = 0, and dP = 0 gives dS = 0.
    if (!mk.tile_full(m0, m0 + kBlockM, n0, n1)) apply_mask_gmma(mk, tScS, m0, n0, acc_s, acc_dp);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_s); ++i) {
      float factor;
      silu(acc_s(i), acc_s(i), factor);
      acc_dp(i) *= factor;
    }
    {
      Tensor rP = convert_fragment<Element>(acc_s);
      copy(copy_PdS, thr_copy_PdS.retile_S(rP), tPsP);
      Tensor rdS = convert_fragment<Element>(acc_dp);
      copy(copy_PdS, thr_copy_PdS.retile_S(rdS), tdSsdS);
    }
    fence_async_shared();
    __syncthreads();  // P, dS visible
    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kDQCols>>{});
    dq_issue(acc_dq, 0);
    gmma_issue<false>(mma_dkv, tdVrPt, tdVrdOt, acc_dv);
    gmma_issue<false>(mma_dkv, tdKrdSt, tdKrQt, acc_dk);
    gmma_wait<2>(acc_dq);
    dq_reduce(acc_dq, m0, 0);
    gmma_wait<1>(acc_dv);
    if (next < m_hi) {
      __syncthreads();  // both warpgroups' dV have read dO: the next one streams in now
      load_rows(g.dout, tdOsdO, next);
    }
    cute::cp_async_fence();
    CUTE_UNROLL
    for (int chunk = 1; chunk < Kt::kDQChunks; ++chunk) {
      dq_issue(acc_dq, chunk);
      gmma_wait<1>(acc_dk);
      if (chunk == 1 && next < m_hi) {
        __syncthreads();  // dK has read Q
        load_rows(g.q, tQsQ, next);
      }
      gmma_wait<0>(acc_dq);
      dq_reduce(acc_dq, m0, chunk);
    }
    if constexpr (Kt::kDQChunks == 1) {
      gmma_wait<0>(acc_dk);
      if (next < m_hi) {
        __syncthreads();
        load_rows(g.q, tQsQ, next);
      }
    }
    cute::cp_async_fence();
    m_block = next;
  }

  // Epilogue: dK, dV -> shared (reusing sK, sV once every wgmma has read them) -> global.
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  auto copy_dKV = make_tiled_copy_C(typename Kt::SmemCopyAtomR2S{}, mma_dkv);
  auto thr_copy_dKV = copy_dKV.get_thread_slice(tidx);
  cute::cp_async_wait<0>();
  __syncthreads();
  Tensor tdKsdK = thr_copy_dKV.partition_D(sK);
  Tensor tdVsdV = thr_copy_dKV.partition_D(sV);
  copy(copy_dKV, thr_copy_dKV.retile_S(rdK), tdKsdK);
  copy(copy_dKV, thr_copy_dKV.retile_S(rdV), tdVsdV);
  __syncthreads();
  store_dkv<Kt>(sK, sV, g, tKVcKV, n0, L, tidx);
#endif
}

}  // namespace hstu
