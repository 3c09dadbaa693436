// Small device helpers: register-pipelined GEMMs over shared memory, layout reshapes,
// predicated tile copies and the SiLU arithmetic.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "params.h"

namespace hstu {

using namespace cute;

// The tile of CTA x of a 1-D grid over (block, sequence, head), pair = h * batch + b. Pairs form
// dispatch groups of p.pair_group, then one last group of the pairs from p.last_group_first on;
// a group's CTAs are dispatched together, block-order major: order index 0 of every pair of the
// group, then 1, and so on (the kernels map order indices heaviest block first). Every CTA of a
// pair streams (nearly) all of that pair's rows of the other side (K/V in the forward; Q, dO and
// the dQ accumulator in the backward), so a group small enough for those to stay in L2 (launch.h
// sizes it) reads them from DRAM about once; a single group over the whole batch streamed them
// from DRAM over and over. The last group is large enough that its heaviest CTAs, dispatched
// first, still finish with the rest of the grid.
__device__ __forceinline__ void grid_tile_of(HstuParams const& p, int x, int n_blocks,
                                             int& order, int& bidb, int& bidh) {
  const int pairs = p.batch * p.heads;
  int first, size;
  if (x < p.last_group_first * n_blocks) {
    first = x / (p.pair_group * n_blocks) * p.pair_group;
    size = p.pair_group;
  } else {
    first = p.last_group_first;
    size = pairs - first;
  }
  const int local = x - first * n_blocks;
  order = local / size;
  const int pair = first + local % size;
  bidh = pair / p.batch;
  bidb = pair % p.batch;
}

// This CTA's tile (grid_tile_of of its full-grid index: blockIdx.x, or through the compacted
// grid's map, launch.h compact_grid); false: the CTA has no tile (past the map's list).
__device__ __forceinline__ bool cta_tile(HstuParams const& p, int n_blocks, int& order, int& bidb,
                                         int& bidh) {
  const int x = p.tile_map ? p.tile_map[blockIdx.x] : int(blockIdx.x);
  if (x < 0) return false;
  grid_tile_of(p, x, n_blocks, order, bidb, bidh);
  return true;
}

// The forward's query block of order index `order` (heaviest first: block 0, whose contextual
// rows see all history, then the last block down to block 1; causal work shrinks with m).
__host__ __device__ __forceinline__ int fwd_block_of_order(int order, int n_blocks) {
  return order == 0 ? 0 : n_blocks - order;
}

// One MUFU op: tanh.approx.f32 (max rel. error ~2^-11), the cheapest route to a sigmoid:
// sigmoid(x) = 0.5 * (1 + tanh(x / 2)), silu(x) = x * sigmoid(x).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Forward SiLU: P = SiLU(alpha s) / scale = h' (1 + tanh(h)), h = alpha s / 2, h' = h / scale
// (half_alpha_scale = alpha / (2 scale)).
__device__ __forceinline__ float silu_scaled(float s, float half_alpha, float half_alpha_scale) {
  const float hs = s * half_alpha_scale;
  return fmaf(hs, tanh_approx(s * half_alpha), hs);
}

// Backward SiLU: with h = alpha s / 2, t = tanh(h) (so sigmoid(alpha s) = (1 + t) / 2) and
// S_len = the scaling length (inv_scale = 1 / S_len):
//   P       = SiLU(alpha s) / S_len                           = h' (1 + t),  h' = h / S_len
//   dS / dP = alpha / S_len sig (1 + alpha s (1 - sig))       = (1 + t) u c,
//             u = 1 + h (1 - t),  c = c_ds = alpha / (2 S_len)
struct SiluBwd {
  float half_alpha, inv_scale, c_ds;
  __device__ __forceinline__ void operator()(float s, float& p, float& ds_factor) const {
    const float h = s * half_alpha;
    const float t = tanh_approx(h);
    const float hs = h * inv_scale;
    p = fmaf(hs, t, hs);
    const float uc = fmaf(fmaf(-h, t, h), c_ds, c_ds);
    ds_factor = fmaf(t, uc, uc);
  }
};

// acc += A @ B^T, A and B both read from shared memory with ldmatrix; the k-slice i + 1 is
// loaded into registers while the tensor cores work on slice i.
template <class Acc, class FragA, class FragB, class SmemA, class SmemB, class TiledMma,
          class CopyA, class CopyB, class ThrCopyA, class ThrCopyB>
__device__ __forceinline__ void gemm_ss(Acc& acc, FragA& tCrA, FragB& tCrB, SmemA const& tCsA,
                                        SmemB const& tCsB, TiledMma const& mma,
                                        CopyA const& copy_a, CopyB const& copy_b,
                                        ThrCopyA const& thr_a, ThrCopyB const& thr_b) {
  auto tCrA_v = thr_a.retile_D(tCrA);
  auto tCrB_v = thr_b.retile_D(tCrB);
  copy(copy_a, tCsA(_, _, _0{}), tCrA_v(_, _, _0{}));
  copy(copy_b, tCsB(_, _, _0{}), tCrB_v(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i < size<2>(tCrA) - 1) {
      copy(copy_a, tCsA(_, _, i + 1), tCrA_v(_, _, i + 1));
      copy(copy_b, tCsB(_, _, i + 1), tCrB_v(_, _, i + 1));
    }
    cute::gemm(mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// acc += A @ B^T like gemm_ss, but each k-slice is loaded right before its MMAs: half the
// operand registers, for the phases where the accumulators leave no room for a second slice.
template <class Acc, class FragA, class FragB, class SmemA, class SmemB, class TiledMma,
          class CopyA, class CopyB, class ThrCopyA, class ThrCopyB>
__device__ __forceinline__ void gemm_ss_lean(Acc& acc, FragA& tCrA, FragB& tCrB,
                                             SmemA const& tCsA, SmemB const& tCsB,
                                             TiledMma const& mma, CopyA const& copy_a,
                                             CopyB const& copy_b, ThrCopyA const& thr_a,
                                             ThrCopyB const& thr_b) {
  auto tCrA_v = thr_a.retile_D(tCrA);
  auto tCrB_v = thr_b.retile_D(tCrB);
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    copy(copy_a, tCsA(_, _, i), tCrA_v(_, _, i));
    copy(copy_b, tCsB(_, _, i), tCrB_v(_, _, i));
    cute::gemm(mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// gemm_ss_lean when kLean, else gemm_ss (a per-configuration choice: whichever spills less).
template <bool kLean, class... Args>
__device__ __forceinline__ void gemm_smem(Args&&... args) {
  if constexpr (kLean) {
    gemm_ss_lean(static_cast<Args&&>(args)...);
  } else {
    gemm_ss(static_cast<Args&&>(args)...);
  }
}

// acc += A @ B^T with A already in registers (P of the forward).
template <class Acc, class FragA, class FragB, class SmemB, class TiledMma, class CopyB,
          class ThrCopyB>
__device__ __forceinline__ void gemm_rs(Acc& acc, FragA const& tCrA, FragB& tCrB,
                                        SmemB const& tCsB, TiledMma const& mma,
                                        CopyB const& copy_b, ThrCopyB const& thr_b) {
  auto tCrB_v = thr_b.retile_D(tCrB);
  copy(copy_b, tCsB(_, _, _0{}), tCrB_v(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i < size<2>(tCrA) - 1) copy(copy_b, tCsB(_, _, i + 1), tCrB_v(_, _, i + 1));
    cute::gemm(mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// m16n8k16 accumulator ((2,2), M, N) viewed as an A operand ((2,2,2), M, N/2): two adjacent n8
// accumulator tiles form one k16 slice.
template <class Layout>
__device__ __forceinline__ constexpr auto acc_layout_as_A(Layout l) {
  auto l2 = logical_divide(l, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(get<0>(l2)), get<1>(get<0>(l2)), get<0>(get<2>(l2))),
                     get<1>(l2), get<1>(get<2>(l2)));
}

// fp32 fragment -> Element fragment of the same layout (packed cvt instructions).
template <typename To, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(Tensor<Engine, Layout> const& t) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(t))::value;
  cutlass::NumericArrayConverter<To, From, N> conv;
  Tensor out = make_tensor<To>(t.layout());
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
      conv(*reinterpret_cast<cutlass::Array<From, N> const*>(t.data()));
  return out;
}

// Copy a [rows, D] global tile into shared memory; rows >= max_rows are zero-filled
// (the zeros are what make out-of-sequence rows harmless: SiLU(0) = 0).
template <class TiledCopy, class SrcT, class DstT, class CoordT>
__device__ __forceinline__ void copy_rows_zfill(TiledCopy const& tiled_copy, SrcT const& src,
                                                DstT& dst, CoordT const& coord, int max_rows) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(dst); ++m) {
    if (get<0>(coord(0, m, 0)) < max_rows) {
      copy(tiled_copy, src(_, m, _), dst(_, m, _));
    } else {
      clear(dst(_, m, _));
    }
  }
}

// Store a [rows, D] shared tile to global memory, rows >= max_rows skipped.
template <class TiledCopy, class SrcT, class DstT, class CoordT>
__device__ __forceinline__ void copy_rows_store(TiledCopy const& tiled_copy, SrcT const& src,
                                                DstT& dst, CoordT const& coord, int max_rows) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < max_rows) copy(tiled_copy, src(_, m, _), dst(_, m, _));
  }
}

// Zero every element of the m16n8k16 accumulators (((2,2), MMA_M, MMA_N), all of one layout)
// whose (row, key) pair the mask rejects. tScS holds each element's (row, col) in the tile.
template <class Mask, class CoordT, class... Accs>
__device__ __forceinline__ void apply_mask(Mask const& mk, CoordT const& tScS, int m0, int n0,
                                           Accs&... accs) {
  auto& acc0 = (accs, ...);
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc0); ++mi) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      int lo1, hi1, lo2, hi2;
      mk.row_keys(m0 + get<0>(tScS(make_coord(0, r), mi, 0)), lo1, hi1, lo2, hi2);
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc0); ++ni) {
        CUTE_UNROLL
        for (int cc = 0; cc < 2; ++cc) {
          const int j = n0 + get<1>(tScS(make_coord(cc, r), mi, ni));
          if (!((j >= lo1 && j < hi1) || (j >= lo2 && j < hi2))) {
            ((accs(make_coord(cc, r), mi, ni) = 0.f), ...);
          }
        }
      }
    }
  }
}

// Validity bits of the m16n8k16 accumulator elements (bit i of word i / 32 = element i of the
// fragment's flat index), computed the same way as apply_mask. Keeping the mask as bits lets the
// backward fold it into its elementwise pass without holding a second fp32 fragment.
template <class Mask, class CoordT, class Acc, int W>
__device__ __forceinline__ void mask_bits(Mask const& mk, CoordT const& tScS, int m0, int n0,
                                          Acc const& acc, uint32_t (&bits)[W]) {
  static_assert(W * 32 >= decltype(size(acc))::value);
  CUTE_UNROLL
  for (int w = 0; w < W; ++w) bits[w] = 0u;
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc); ++mi) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      int lo1, hi1, lo2, hi2;
      mk.row_keys(m0 + get<0>(tScS(make_coord(0, r), mi, 0)), lo1, hi1, lo2, hi2);
      CUTE_UNROLL
      for (int ni = 0; ni < size<2>(acc); ++ni) {
        CUTE_UNROLL
        for (int cc = 0; cc < 2; ++cc) {
          const int j = n0 + get<1>(tScS(make_coord(cc, r), mi, ni));
          const int idx = acc.layout()(make_coord(cc, r), mi, ni);
          if ((j >= lo1 && j < hi1) || (j >= lo2 && j < hi2)) bits[idx / 32] |= 1u << (idx % 32);
        }
      }
    }
  }
}

}  // namespace hstu
