// HSTU attention backward: one CTA per (key block, sequence, head) keeps K, V and the dK, dV
// accumulators on chip and walks the query blocks that can see its keys:
//   S = Q K^T, dP = dO V^T                       (recomputed, fp32)
//   P = SiLU(alpha S) / scale, dS = dP * alpha SiLU'(alpha S) / scale   (masked)
//   dV += P^T dO, dK += dS^T Q                   (P, dS staged in shared memory as Element)
//   dQ += dS K                                   (fp32 reductions into the head-major dq_accum,
//                                                 issued before the dK GEMM so they overlap it;
//                                                 in deterministic mode the key blocks of one
//                                                 query block take turns in key-block order via
//                                                 a semaphore)
// Two schedules: S first with dQ before dK (Q/dO double-buffered, or single-buffered with the
// next dO/Q loaded as soon as the GEMMs reading them are done), and kDPFirst (single-buffered:
// dP, S, dV, dK, dQ, so both loads overlap MMAs; d128, and d256 on 224 KB). With
// HstuParams::dq_counter the last key block to reduce into a query block also converts it to dq.
#pragma once

#include <cute/tensor.hpp>

#include "bias.h"
#include "fwd_kernel.h"
#include "kernel_traits.h"
#include "mask.h"
#include "params.h"
#include "utils.h"

namespace hstu {

using namespace cute;

__device__ __forceinline__ void semaphore_wait(const int* sem, int value) {
  while (atomicAdd(const_cast<int*>(sem), 0) != value) {
  }
  __threadfence();
}

// dq_accum += a pair of fp32 values at adjacent columns (8-byte aligned): one vector reduction
// on SM90 (red.global.add.v2.f32), two scalar ones on older architectures.
__device__ __forceinline__ void red_add_f32x2(float* ptr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(ptr), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(ptr, a);
  atomicAdd(ptr + 1, b);
#endif
}

// *ptr += v with release semantics at GPU scope (no L1 invalidation, unlike a full fence);
// returns the old value.
__device__ __forceinline__ int atomic_add_release(int* ptr, int v) {
  int old;
  asm volatile("atom.add.release.gpu.global.s32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(ptr), "r"(v)
               : "memory");
  return old;
}

// The key block of a backward CTA (1-D grid over (key block, sequence, head) in dispatch
// groups, grid_tile_of), the thread's index, and the sequence's first row and length; false
// when the block starts past the sequence's end (the CTA has nothing to do). Both backward
// kernels. (The thread index is read between the two, where the kernels read it before.)
template <int kBlockN>
__device__ __forceinline__ bool locate_key_block(HstuParams const& p, int& n_block, int& bidb,
                                                 int& bidh, int& tidx, int& seq_start, int& L,
                                                 int& n0) {
  if (!cta_tile(p, (p.max_seqlen + kBlockN - 1) / kBlockN, n_block, bidb, bidh)) return false;
  tidx = threadIdx.x;
  seq_start = p.cu_seqlens[bidb];
  L = p.cu_seqlens[bidb + 1] - seq_start;
  n0 = n_block * kBlockN;
  return n0 < L;
}

// The rows a backward CTA reads and writes, from its sequence's first row in its head (element
// offset base): q, k, v, dO, dK, dV ([T, H, D], row stride p.row_stride) and dq_accum,
// head-major [H, T, D], where the row stride is the compile-time D (every dQ reduction address
// is one base register plus an immediate offset). Both backward kernels.
template <typename Element, int kHeadDim>
struct BwdRows {
  HstuParams const& p;
  int64_t base;
  const Element *q, *k, *v, *dout;
  float* dqacc;
  Element *dk, *dv;

  __device__ __forceinline__ BwdRows(HstuParams const& params, int seq_start, int bidh)
      : p(params) {
    base = int64_t(seq_start) * p.row_stride + int64_t(bidh) * p.head_stride;
    q = reinterpret_cast<const Element*>(p.q) + base;
    k = reinterpret_cast<const Element*>(p.k) + base;
    v = reinterpret_cast<const Element*>(p.v) + base;
    dout = reinterpret_cast<const Element*>(p.dout) + base;
    dqacc = p.dq_accum + (int64_t(bidh) * p.total + seq_start) * kHeadDim;
    dk = reinterpret_cast<Element*>(p.dk) + base;
    dv = reinterpret_cast<Element*>(p.dv) + base;
  }

  // The [rows x kHeadDim] tile of ptr's rows from row0.
  template <typename T, typename Rows>
  __device__ __forceinline__ auto tile(T* ptr, int row0, Rows rows) const {
    return make_tensor(make_gmem_ptr(ptr + int64_t(row0) * p.row_stride),
                       make_shape(rows, Int<kHeadDim>{}), make_stride(p.row_stride, _1{}));
  }
};

// Epilogue of both backward kernels: the dK and dV tiles, staged in shared memory (sK, sV),
// stored to the key block's rows (rows past the sequence skipped) with 16-byte stores.
template <typename Kt, class SmemK, class SmemV, class Rows, class Coord>
__device__ __forceinline__ void store_dkv(SmemK const& sK, SmemV const& sV, Rows const& g,
                                          Coord const& tKVcKV, int n0, int L, int tidx) {
  typename Kt::GmemTiledCopyStore gmem_tiled_copy_st;
  auto gmem_thr_copy_st = gmem_tiled_copy_st.get_thread_slice(tidx);
  Tensor tdKsK = gmem_thr_copy_st.partition_S(sK);
  Tensor tdVsV = gmem_thr_copy_st.partition_S(sV);
  Tensor tdKgdK = gmem_thr_copy_st.partition_D(g.tile(g.dk, n0, Int<Kt::kBlockN>{}));
  Tensor tdVgdV = gmem_thr_copy_st.partition_D(g.tile(g.dv, n0, Int<Kt::kBlockN>{}));
  copy_rows_store(gmem_tiled_copy_st, tdKsK, tdKgdK, tKVcKV, L - n0);
  copy_rows_store(gmem_tiled_copy_st, tdVsV, tdVgdV, tKVcKV, L - n0);
}

// kBias: the relative attention bias (bias.h) enters every score tile, and its two weight
// gradients are summed in shared memory (bias_smem_bytes past Kt::kSmemSize) and flushed into
// p.dpos_w / p.dtime_w. kTime = false compiles the time term out (the position-only kernel:
// the time code's registers made the d128 kernel spill ~5x more, docs/kernels.md).
template <typename Kt, bool kBias, bool kTime = kBias>
__global__ void __launch_bounds__(Kt::kNWarps * 32, 1)
    hstu_bwd_kernel(const __grid_constant__ HstuParams p) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  constexpr int kDQCols = Kt::kDQCols;
  constexpr int kQdOElems = int(size(typename Kt::SmemLayoutQdO{}));
  extern __shared__ __align__(1024) char smem_[];

  // 1-D grid over (key block, sequence, head) in dispatch groups of (sequence, head) pairs
  // (grid_tile_of): inside a group key block 0 (the most query blocks under a causal mask) of
  // each pair goes first, the lightest blocks last. Deterministic mode relies on key block n - 1
  // of a pair being dispatched before key block n.
  int n_block, bidb, bidh, tidx, seq_start, L, n0;
  if (!locate_key_block<kBlockN>(p, n_block, bidb, bidh, tidx, seq_start, L, n0)) return;
  const SeqMask mk = make_seq_mask(p, bidb, L);
  const int n1 = min(n0 + kBlockN, L);
  int m_lo, m_hi;
  mk.key_block_query_blocks(n0, n1, kBlockM, m_lo, m_hi);
  const int num_m_blocks = (L + kBlockM - 1) / kBlockM;
  auto next_active = [&](int m) {
    ++m;
    while (m < m_hi && mk.tile_empty(m * kBlockM, (m + 1) * kBlockM, n0, n1)) ++m;
    return m;
  };
  int* sem_row = p.deterministic ? p.dq_semaphore + (int64_t(bidh) * p.batch + bidb) *
                                                        ((p.max_seqlen + kBlockM - 1) / kBlockM)
                                 : nullptr;
  // In-kernel dQ conversion (p.dq_counter set, not deterministic): after its dQ reductions for a
  // query block have landed, a CTA counts itself on the block's counter; the CTA that brings it
  // to the number of key blocks processing that query block converts the block's rows.
  int* cnt_row = (p.dq_counter != nullptr && !p.deterministic)
                     ? p.dq_counter + (int64_t(bidh) * p.batch + bidb) *
                                          ((p.max_seqlen + kBlockM - 1) / kBlockM)
                     : nullptr;
  const int num_n_blocks = (L + kBlockN - 1) / kBlockN;
  // Whether the CTA of key block nb processes query block m (the walk of mask.h, as our loop).
  auto processes = [&](int nb, int m) {
    return mk.key_block_visits(nb * kBlockN, min(nb * kBlockN + kBlockN, L), m, kBlockM);
  };
  // Deterministic mode: every key block takes its turn on every query block, active or not.
  auto pass_through = [&](int from, int to) {
    if (sem_row != nullptr && tidx == 0) {
      for (int m = from; m < to; ++m) {
        semaphore_wait(sem_row + m, n_block);
        atomicExch(sem_row + m, n_block + 1);
      }
    }
  };

  const BwdRows<Element, kHeadDim> g(p, seq_start, bidh);

  Element* smem_base = reinterpret_cast<Element*>(smem_);
  Tensor sQ = make_tensor(make_smem_ptr(smem_base), typename Kt::SmemLayoutQdO{});
  Tensor sQt = make_tensor(sQ.data(), typename Kt::SmemLayoutQdOt{});
  Tensor sQtNoSwizzle = make_tensor(sQ.data().get(), typename Kt::SmemLayoutQdOtNoSwizzle{});
  Tensor sdO = make_tensor(sQ.data() + Kt::kStages * kQdOElems, typename Kt::SmemLayoutQdO{});
  Tensor sdOt = make_tensor(sdO.data(), typename Kt::SmemLayoutQdOt{});
  Tensor sdOtNoSwizzle = make_tensor(sdO.data().get(), typename Kt::SmemLayoutQdOtNoSwizzle{});
  Tensor sK = make_tensor(sdO.data() + Kt::kStages * kQdOElems, typename Kt::SmemLayoutKV{});
  Tensor sKtC = make_tensor(sK.data(), typename Kt::SmemLayoutKtChunk{});
  Tensor sKtCNoSwizzle =
      make_tensor(sK.data().get(), typename Kt::SmemLayoutKtChunkNoSwizzle{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Kt::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename Kt::SmemLayoutPdS{});
  Tensor sPt = make_tensor(sP.data(), typename Kt::SmemLayoutPdSt{});
  Tensor sPtNoSwizzle = make_tensor(sP.data().get(), typename Kt::SmemLayoutPdStNoSwizzle{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename Kt::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(sdS.data(), typename Kt::SmemLayoutPdSt{});
  Tensor sdStNoSwizzle = make_tensor(sdS.data().get(), typename Kt::SmemLayoutPdStNoSwizzle{});

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
  auto load_rows = [&](const Element* ptr, auto const& dst_base, int m, int stage) {
    Tensor dst = make_tensor(dst_base.data() + stage * kQdOElems, dst_base.layout());
    Tensor src = gmem_thr_copy.partition_S(g.tile(ptr, m * kBlockM, Int<kBlockM>{}));
    copy_rows_zfill(gmem_tiled_copy, src, dst, tQcQ, L - m * kBlockM);
  };

  // MMAs and their shared -> register copies.
  typename Kt::TiledMmaSdP tiled_mma_sdp;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);

  typename Kt::TiledMmadKV tiled_mma_dkv;
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(tidx);
  Tensor tdVrPt = thr_mma_dkv.partition_fragment_A(sPtNoSwizzle);
  Tensor tdVrdO = thr_mma_dkv.partition_fragment_B(sdOtNoSwizzle);
  Tensor tdKrdSt = thr_mma_dkv.partition_fragment_A(sdStNoSwizzle);
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQtNoSwizzle);

  typename Kt::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKtCNoSwizzle);

  auto copy_QdO = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma_sdp);
  auto thr_copy_QdO = copy_QdO.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_QdO.partition_S(sQ);
  Tensor tdPsdO = thr_copy_QdO.partition_S(sdO);
  auto copy_KV = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma_sdp);
  auto thr_copy_KV = copy_KV.get_thread_slice(tidx);
  Tensor tSsK = thr_copy_KV.partition_S(sK);
  Tensor tdPsV = thr_copy_KV.partition_S(sV);

  auto copy_PdSt = make_tiled_copy_A(typename Kt::SmemCopyAtomT{}, tiled_mma_dkv);
  auto thr_copy_PdSt = copy_PdSt.get_thread_slice(tidx);
  Tensor tdVsPt = thr_copy_PdSt.partition_S(sPt);
  Tensor tdKsdSt = thr_copy_PdSt.partition_S(sdSt);
  auto copy_QdOt = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, tiled_mma_dkv);
  auto thr_copy_QdOt = copy_QdOt.get_thread_slice(tidx);
  Tensor tdVsdOt = thr_copy_QdOt.partition_S(sdOt);
  Tensor tdKsQt = thr_copy_QdOt.partition_S(sQt);

  auto copy_dS = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma_dq);
  auto thr_copy_dS = copy_dS.get_thread_slice(tidx);
  Tensor tdQsdS = thr_copy_dS.partition_S(sdS);
  auto copy_Kt = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, tiled_mma_dq);
  auto thr_copy_Kt = copy_Kt.get_thread_slice(tidx);
  Tensor tdQsKt = thr_copy_Kt.partition_S(sKtC);

  auto copy_PdS = make_tiled_copy_C(typename Kt::SmemCopyAtomR2S{}, tiled_mma_sdp);
  auto thr_copy_PdS = copy_PdS.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_PdS.partition_D(sP);
  Tensor tdSsdS = thr_copy_PdS.partition_D(sdS);

  Tensor tScS = thr_mma_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tdQcdQ =
      thr_mma_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kDQCols>>{}));

  Tensor acc_dk = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  // The GEMMs of one query block; `off` selects the Q/dO stage.
  auto gemm_S = [&](auto& acc, int off) {
    gemm_smem<Kt::kLeanGemms>(acc, tSrQ, tSrK, make_tensor(tSsQ.data() + off, tSsQ.layout()),
                              tSsK, tiled_mma_sdp, copy_QdO, copy_KV, thr_copy_QdO, thr_copy_KV);
  };
  auto gemm_dP = [&](auto& acc, int off) {
    gemm_ss_lean(acc, tdPrdO, tdPrV, make_tensor(tdPsdO.data() + off, tdPsdO.layout()), tdPsV,
                 tiled_mma_sdp, copy_QdO, copy_KV, thr_copy_QdO, thr_copy_KV);
  };
  auto gemm_dV = [&](int off) {
    gemm_smem<Kt::kLeanGemms>(acc_dv, tdVrPt, tdVrdO, tdVsPt,
                              make_tensor(tdVsdOt.data() + off, tdVsdOt.layout()), tiled_mma_dkv,
                              copy_PdSt, copy_QdOt, thr_copy_PdSt, thr_copy_QdOt);
  };
  auto gemm_dK = [&](int off) {
    gemm_smem<Kt::kLeanGemms>(acc_dk, tdKrdSt, tdKrQt, tdKsdSt,
                              make_tensor(tdKsQt.data() + off, tdKsQt.layout()), tiled_mma_dkv,
                              copy_PdSt, copy_QdOt, thr_copy_PdSt, thr_copy_QdOt);
  };
  // dQ = dS K, one column chunk at a time, reduced into dq_accum (fire-and-forget atomics that
  // overlap the GEMMs that follow). Deterministic mode: wait for key block n_block - 1 first.
  auto dq_reduce = [&](int m_block) {
    const int m0 = m_block * kBlockM;
    if (sem_row != nullptr) {
      if (tidx == 0) semaphore_wait(sem_row + m_block, n_block);
      __syncthreads();
    }
    const int rows = L - m0;
    CUTE_UNROLL
    for (int chunk = 0; chunk < Kt::kDQChunks; ++chunk) {
      Tensor acc_dq = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kDQCols>>{});
      clear(acc_dq);
      gemm_smem<Kt::kLeanGemms>(
          acc_dq, tdQrdS, tdQrKt, tdQsdS,
          make_tensor(tdQsKt.data() + chunk * kBlockN * kDQCols, tdQsKt.layout()), tiled_mma_dq,
          copy_dS, copy_Kt, thr_copy_dS, thr_copy_Kt);
      Tensor gdQacc = make_tensor(
          make_gmem_ptr(g.dqacc + int64_t(m0) * kHeadDim + chunk * kDQCols),
          Shape<Int<kBlockM>, Int<kDQCols>>{}, Stride<Int<kHeadDim>, _1>{});
      Tensor tdQgdQacc = thr_mma_dq.partition_C(gdQacc);
      static_assert(decltype(size<0>(acc_dq))::value == 4);
      CUTE_UNROLL
      for (int mi = 0; mi < size<1>(acc_dq); ++mi) {
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          if (get<0>(tdQcdQ(make_coord(0, r), mi, 0)) < rows) {
            CUTE_UNROLL
            for (int ni = 0; ni < size<2>(acc_dq); ++ni) {
              red_add_f32x2(&tdQgdQacc(make_coord(0, r), mi, ni),
                            acc_dq(make_coord(0, r), mi, ni), acc_dq(make_coord(1, r), mi, ni));
            }
          }
        }
      }
    }
    if (sem_row != nullptr) {
      __threadfence();
      __syncthreads();
      if (tidx == 0) atomicExch(sem_row + m_block, n_block + 1);
    }
  };

  // The counting is spread over two barriers the schedule has anyway, a GEMM after the
  // reductions were issued (so the release finds them done):
  //   dq_count_begin  (replaces barrier 1): returns the number of key blocks processing query
  //                   block `pending`;
  //   dq_count_arrive (after barrier 1): thread 0 adds 1 to the counter with release semantics
  //                   (after the barrier, that orders every thread's reductions before it, as
  //                   CUTLASS's split-K semaphore does); the last arriver acquires (fence);
  //   dq_count_finish (replaces barrier 2): the last arriver converts the block.
  // pending < 0: nothing to count, and the calls are plain barriers.
  auto dq_count_begin = [&](int pending) {
    if (cnt_row == nullptr || pending < 0) {
      __syncthreads();
      return 0;
    }
    int expected = 0;
    for (int nb0 = 0; nb0 < num_n_blocks; nb0 += Kt::kNThreads) {
      const int nb = nb0 + tidx;
      expected += __syncthreads_count(nb < num_n_blocks && processes(nb, pending));
    }
    return expected;
  };
  auto dq_count_arrive = [&](int pending, int expected) {
    bool last = false;
    if (cnt_row != nullptr && pending >= 0 && tidx == 0) {
      last = atomic_add_release(cnt_row + pending, 1) == expected - 1;
      if (last) {
        __threadfence();  // acquire: every other CTA's reductions are visible
        cnt_row[pending] = 0;  // the counters are left zeroed for the next call
      }
    }
    return last;
  };
  auto dq_count_finish = [&](int pending, bool last) {
    if (!__syncthreads_or(last)) return;
    const int m0 = pending * kBlockM;
    const int rows = min(kBlockM, L - m0);
    const float* src = g.dqacc + int64_t(m0) * kHeadDim;
    Element* dst = reinterpret_cast<Element*>(p.dq) + g.base + int64_t(m0) * p.row_stride;
    constexpr int kVecs = kHeadDim / 4;
    for (int i = tidx; i < rows * kVecs; i += Kt::kNThreads) {
      const int r = i / kVecs;
      const int c = (i % kVecs) * 4;
      // L2 only: other SMs' reductions are not in this SM's L1.
      const float4 a = __ldcg(reinterpret_cast<const float4*>(src + r * kHeadDim + c));
      cutlass::Array<float, 4> in;
      in[0] = a.x;
      in[1] = a.y;
      in[2] = a.z;
      in[3] = a.w;
      const cutlass::Array<Element, 4> o = cutlass::NumericArrayConverter<Element, float, 4>{}(in);
      *reinterpret_cast<uint2*>(dst + int64_t(r) * p.row_stride + c) =
          *reinterpret_cast<const uint2*>(&o);
    }
  };

  // P and the dS factor of each score (SiluBwd, utils.h).
  const float half_alpha = 0.5f * p.alpha;
  const float inv_scale = p.inv_scale_ptr ? *p.inv_scale_ptr : p.inv_scale;
  const SiluBwd silu{half_alpha, inv_scale, 0.5f * p.alpha * inv_scale};

  // Relative bias (bias.h): tables in shared memory past the tiles. Tile t (the t-th query block
  // of the walk) reads diagonal and query-time buffer t % 2; after its first barrier, tile t + 1
  // fills those of tile t + 2 into buffer t % 2, so no extra barrier is needed. The key tile is
  // fixed: its timestamps are loaded once. The recomputed bias leaves the tile's time buckets in
  // shared memory for the time gradient. Weight gradients: the position sums go to global
  // memory per tile, the time histogram sums the whole CTA and is flushed after the epilogue's
  // barrier.
  // kTime = false: has_time is a constant false for every bias function below.
  [[maybe_unused]] const auto bt =
      bias_tables<kBlockM, kBlockN, true, kTime>(p, smem_ + Kt::kSmemSize);
  int tile_buf = 0;
  auto bias_tile_start = [&](int next) {  // after the iteration's first barrier
    if constexpr (kBias) {
      if (next < m_hi) {
        fill_diagonals<kBlockM, kBlockN, Kt::kNThreads>(p, bidh, bt, tile_buf ^ 1,
                                                        next * kBlockM, n0, tidx);
        fill_query_times<kBlockM, Kt::kNThreads>(p, bt, tile_buf ^ 1, bidb, seq_start, L,
                                                 next * kBlockM, tidx);
      }
    }
  };
  auto add_bias = [&](auto& acc) {
    if constexpr (kBias) {
      add_rel_bias<kBlockM>(bt, tile_buf, 0, tile_buf, tScS, acc);
    }
  };
  // After the barrier that makes the tile's sdS visible to every thread.
  auto accumulate_tile = [&](int m0) {
    if constexpr (kBias) {
      accumulate_time_grad<kBlockM, kBlockN, Kt::kNThreads>(bt, sdS, L, m0, n0, tidx);
      accumulate_pos_grad<kBlockM, kBlockN, Kt::kNThreads>(p, bidh, sdS, L, m0, n0, tidx);
      tile_buf ^= 1;
    }
  };

  int m_block = m_lo;
  if (m_block < m_hi && mk.tile_empty(m_block * kBlockM, (m_block + 1) * kBlockM, n0, n1)) {
    m_block = next_active(m_block);
  }
  if constexpr (kBias) {  // covered by the first barrier of the walk (or the epilogue's)
    load_bias_constants<Kt::kNThreads>(p, bidh, bt, tidx, true);
    fill_key_timestamps<kBlockN, Kt::kNThreads>(p, bt, 0, seq_start, L, n0, tidx);
    if (m_block < m_hi) {
      fill_diagonals<kBlockM, kBlockN, Kt::kNThreads>(p, bidh, bt, 0, m_block * kBlockM, n0,
                                                      tidx);
      fill_query_times<kBlockM, Kt::kNThreads>(p, bt, 0, bidb, seq_start, L, m_block * kBlockM,
                                               tidx);
    }
  }
  {
    Tensor gk = gmem_thr_copy.partition_S(g.tile(g.k, n0, Int<kBlockN>{}));
    Tensor gv = gmem_thr_copy.partition_S(g.tile(g.v, n0, Int<kBlockN>{}));
    copy_rows_zfill(gmem_tiled_copy, gk, tKsK, tKVcKV, L - n0);
    copy_rows_zfill(gmem_tiled_copy, gv, tVsV, tKVcKV, L - n0);
  }
  if constexpr (Kt::kDPFirst) {
    // Two cp.async groups in flight across iterations: dO (needed first), then Q.
    if (m_block < m_hi) load_rows(g.dout, tdOsdO, m_block, 0);
    cute::cp_async_fence();
    if (m_block < m_hi) load_rows(g.q, tQsQ, m_block, 0);
    cute::cp_async_fence();
    pass_through(0, min(m_block, num_m_blocks));
    int pending = -1;  // the preceding query block, whose dQ conversion count is still to do
    while (m_block < m_hi) {
      const int m0 = m_block * kBlockM;
      const int next = next_active(m_block);
      // dO (and K, V) have landed; every warp is done with the preceding block's sdS.
      cute::cp_async_wait<1>();
      __syncthreads();
      bias_tile_start(next);
      Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_dP(acc_dp, 0);
      cute::cp_async_wait<0>();
      const int expected = dq_count_begin(pending);  // the barrier: Q has landed
      const bool last = dq_count_arrive(pending, expected);
      Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_S(acc_s, 0);
      add_bias(acc_s);
      // Masked elements: s = 0 gives P = 0, and dP = 0 gives dS = 0.
      if (!mk.tile_full(m0, m0 + kBlockM, n0, n1)) apply_mask(mk, tScS, m0, n0, acc_s, acc_dp);
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
      dq_count_finish(pending, last);  // the barrier before dV
      accumulate_tile(m0);
      gemm_dV(0);
      if (next < m_hi) {
        __syncthreads();  // dO is read by dP and dV only: the next one streams in now
        load_rows(g.dout, tdOsdO, next, 0);
      }
      cute::cp_async_fence();
      gemm_dK(0);
      if (next < m_hi) {
        __syncthreads();  // Q is read by S and dK only
        load_rows(g.q, tQsQ, next, 0);
      }
      cute::cp_async_fence();
      dq_reduce(m_block);
      pass_through(m_block + 1, min(next, num_m_blocks));
      pending = m_block;
      m_block = next;
    }
    if (pending >= 0 && cnt_row != nullptr) {
      const int expected = dq_count_begin(pending);
      dq_count_finish(pending, dq_count_arrive(pending, expected));
    }
  } else {
    if (m_block < m_hi) {
      load_rows(g.q, tQsQ, m_block, 0);
      load_rows(g.dout, tdOsdO, m_block, 0);
    }
    cute::cp_async_fence();
    pass_through(0, min(m_block, num_m_blocks));
    int stage = 0;  // the Q/dO buffer of the current query block
    int pending = -1;  // the preceding query block, whose dQ conversion count is still to do
    while (m_block < m_hi) {
      const int off = stage * kQdOElems;
      const int m0 = m_block * kBlockM;
      const int next = next_active(m_block);
      // Q/dO of this block have landed, and every warp is done with the preceding block's sP/sdS
      // and with the stage the prefetch below overwrites.
      cute::cp_async_wait<0>();
      const int expected = dq_count_begin(pending);  // the barrier
      const bool last = dq_count_arrive(pending, expected);
      bias_tile_start(next);
      if (Kt::kDoubleBuffer && next < m_hi) {
        load_rows(g.q, tQsQ, next, stage ^ 1);
        load_rows(g.dout, tdOsdO, next, stage ^ 1);
        cute::cp_async_fence();
      }

      // S = Q K^T -> P (stored) and the dS factor (kept in registers, masked entries zeroed).
      Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_S(acc_s, off);
      add_bias(acc_s);
      // Masked elements: s = 0 gives P = 0, and their factor is zeroed, so dS = 0 too. The mask
      // is first taken as bits so that only one fp32 fragment is live while the rules are
      // evaluated.
      const bool tile_full = mk.tile_full(m0, m0 + kBlockM, n0, n1);
      constexpr int kMaskWords = (int(decltype(size(acc_s))::value) + 31) / 32;
      uint32_t valid[kMaskWords];
      if (!tile_full) {
        mask_bits(mk, tScS, m0, n0, acc_s, valid);
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) {
          if (!((valid[i / 32] >> (i % 32)) & 1u)) acc_s(i) = 0.f;
        }
      }
      Tensor rP = make_tensor<Element>(acc_s.layout());
      {
        cutlass::NumericArrayConverter<Element, float, 2> cvt2;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); i += 2) {
          cutlass::Array<float, 2> pr;
          CUTE_UNROLL
          for (int e = 0; e < 2; ++e) silu(acc_s(i + e), pr[e], acc_s(i + e));
          *reinterpret_cast<cutlass::Array<Element, 2>*>(&rP(i)) = cvt2(pr);
        }
      }
      if (!tile_full) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) {
          if (!((valid[i / 32] >> (i % 32)) & 1u)) acc_s(i) = 0.f;
        }
      }
      copy(copy_PdS, thr_copy_PdS.retile_S(rP), tPsP);

      // dP = dO V^T -> dS = dP * factor (stored).
      Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_dP(acc_dp, off);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dp); ++i) acc_dp(i) *= acc_s(i);
      {
        Tensor rdS = convert_fragment<Element>(acc_dp);
        copy(copy_PdS, thr_copy_PdS.retile_S(rdS), tdSsdS);
      }
      dq_count_finish(pending, last);  // the barrier before dV
      accumulate_tile(m0);

      gemm_dV(off);
      if (!Kt::kDoubleBuffer && next < m_hi) {
        __syncthreads();  // the rest of this block does not read dO: the next one streams in now
        load_rows(g.dout, tdOsdO, next, 0);
        cute::cp_async_fence();
      }
      // dQ before dK, so that its reductions overlap the dK GEMM (FlashAttention-2's order).
      dq_reduce(m_block);
      pass_through(m_block + 1, min(next, num_m_blocks));
      gemm_dK(off);
      if (!Kt::kDoubleBuffer && next < m_hi) {
        __syncthreads();
        load_rows(g.q, tQsQ, next, 0);
        cute::cp_async_fence();
      }
      if (Kt::kDoubleBuffer) stage ^= 1;
      pending = m_block;
      m_block = next;
    }
    if (pending >= 0 && cnt_row != nullptr) {
      const int expected = dq_count_begin(pending);
      dq_count_finish(pending, dq_count_arrive(pending, expected));
    }
  }
  pass_through(max(m_block, 0), num_m_blocks);

  // Epilogue: dK, dV -> shared (reusing sK, sV) -> global.
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  auto copy_dKV = make_tiled_copy_C(typename Kt::SmemCopyAtomR2S{}, tiled_mma_dkv);
  auto thr_copy_dKV = copy_dKV.get_thread_slice(tidx);
  cute::cp_async_wait<0>();
  __syncthreads();
  if constexpr (kBias) {
    if (bt.has_time) flush_time_hist<Kt::kNThreads>(p, bidh, bt, tidx);
  }
  Tensor tdKsdK = thr_copy_dKV.partition_D(sK);
  Tensor tdVsdV = thr_copy_dKV.partition_D(sV);
  copy(copy_dKV, thr_copy_dKV.retile_S(rdK), tdKsdK);
  copy(copy_dKV, thr_copy_dKV.retile_S(rdV), tdVsdV);
  __syncthreads();
  store_dkv<Kt>(sK, sV, g, tKVcKV, n0, L, tidx);
}

// dq_accum [H, T, D] fp32 (head-major) -> dq [T, H, D] Element; grid (chunks of T * D / 4, H).
template <typename Element, int kHeadDim>
__global__ void hstu_convert_dq_kernel(const float* __restrict__ acc, Element* __restrict__ out,
                                       int total, int64_t row_stride, int64_t head_stride) {
  static_assert(kHeadDim % 4 == 0);
  const int64_t per_head = int64_t(total) * kHeadDim;
  const int64_t j = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (j >= per_head) return;
  const int h = blockIdx.y;
  const int64_t t = j / kHeadDim;
  const int d = int(j % kHeadDim);
  // One 16-byte load, one 8-byte store (row and head strides are multiples of 4 elements).
  const float4 a = *reinterpret_cast<const float4*>(acc + int64_t(h) * per_head + j);
  cutlass::Array<float, 4> in;
  in[0] = a.x;
  in[1] = a.y;
  in[2] = a.z;
  in[3] = a.w;
  const cutlass::Array<Element, 4> o = cutlass::NumericArrayConverter<Element, float, 4>{}(in);
  *reinterpret_cast<uint2*>(out + t * row_stride + int64_t(h) * head_stride + d) =
      *reinterpret_cast<const uint2*>(&o);
}

}  // namespace hstu
