// Tile shapes, shared-memory layouts and copy atoms of the HSTU attention kernels (SM80 CuTe).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace hstu {

using namespace cute;

template <typename Element>
struct MmaAtomFor;
template <>
struct MmaAtomFor<cutlass::half_t> {
  using type = MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>;
};
template <>
struct MmaAtomFor<cutlass::bfloat16_t> {
  using type = MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>;
};

// Swizzled K-major tile of kRows x kCols: an 8 x kBlockK atom (64 or 32 halves wide = 128 / 64 B)
// XOR-swizzled so that ldmatrix rows and 16-byte cp.async writes are bank-conflict free.
template <int kBlockK>
struct SmemAtom {
  static constexpr int kSwizzle = kBlockK == 32 ? 2 : 3;
  using type = decltype(composition(
      Swizzle<kSwizzle, 3, 3>{},
      Layout<Shape<_8, Int<kBlockK>>, Stride<Int<kBlockK>, _1>>{}));
};

template <typename Element_, int kHeadDim_, int kNThreads_>
struct BaseTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNThreads = kNThreads_;
  static constexpr int kNWarps = kNThreads / 32;
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  using MmaAtom = typename MmaAtomFor<Element>::type;
  using SmemLayoutAtomQKV = typename SmemAtom<kBlockKSmem>::type;

  // 16-byte cp.async, one row of kBlockKSmem elements covered by kGmemThreadsPerRow threads.
  static constexpr int kGmemElemsPerLoad = 8;
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  static constexpr int kGmemRowsPerPass = kNThreads / kGmemThreadsPerRow;
  using GmemLayoutAtom = Layout<Shape<Int<kGmemRowsPerPass>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopyLoad = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, _8>>{}));
  using GmemTiledCopyStore = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, _8>>{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomR2S = Copy_Atom<UniversalCopy<uint32_t>, Element>;
};

// Forward: kBlockM query rows per CTA, kBlockN keys per step. kWarpsN == 1: warps stacked along
// M (16 rows each), P stays in registers as the A operand of P V. kWarpsN > 1 (kPSmem): warps in a
// kWarpsM x kWarpsN grid for both GEMMs, so each warp's S tile is wider than 16 rows and reads
// fewer K bytes per MAC; P then goes through shared memory (sP), since a warp's P rows span the
// S tiles of the kWarpsN warps beside it.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_,
          int kWarpsN_ = 1>
struct FwdTraits : BaseTraits<Element_, kHeadDim_, kNWarps_ * 32> {
  using Base = BaseTraits<Element_, kHeadDim_, kNWarps_ * 32>;
  using Element = typename Base::Element;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kWarpsM = kNWarps / kWarpsN;
  static constexpr bool kPSmem = kWarpsN > 1;
  static_assert(kNWarps % kWarpsN == 0 && kBlockM % (16 * kWarpsM) == 0);
  static_assert(kBlockN % (16 * kWarpsN) == 0);

  using TiledMma = TiledMMA<typename Base::MmaAtom, Layout<Shape<Int<kWarpsM>, Int<kWarpsN>, _1>>,
                            Tile<Int<16 * kWarpsM>, Int<16 * kWarpsN>, _16>>;

  using SmemLayoutQ = decltype(tile_to_shape(typename Base::SmemLayoutAtomQKV{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(typename Base::SmemLayoutAtomQKV{},
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V viewed as [D, kBlockN] (the B operand of P @ V, read with ldmatrix.trans).
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutP = decltype(tile_to_shape(typename SmemAtom<kBlockN >= 64 ? 64 : 32>::type{},
                                             Shape<Int<kBlockM>, Int<kBlockN>>{}));

  static constexpr int kSmemQ = int(size(SmemLayoutQ{})) * sizeof(Element);
  static constexpr int kSmemKV = int(size(SmemLayoutKV{})) * sizeof(Element);
  static constexpr int kSmemP = kPSmem ? int(size(SmemLayoutP{})) * sizeof(Element) : 0;
  static constexpr int kSmemSize = kSmemQ + 2 * kSmemKV + kSmemP;
  static_assert(kBlockM % Base::kGmemRowsPerPass == 0 && kBlockN % Base::kGmemRowsPerPass == 0);
};

// Backward: one CTA per key block (kBlockN keys), looping over query blocks of kBlockM rows.
// Three tiled MMAs: S/dP = [M x N], dK/dV = [N x D], dQ = [M x D]; the Atom* parameters say how
// many warps stack along the first mode of each.
// dQ = dS K is computed kDQChunks column chunks of the head dim at a time (each chunk's fp32
// accumulator is flushed with atomics before the next), which caps its registers at d256.
// kLeanGemms: every GEMM loads each k-slice right before its MMAs (fewer operand registers)
// instead of prefetching the next slice; chosen per configuration by ptxas spills.
// kDPFirst (single-buffered Q/dO only): per query block dP = dO V^T runs before S = Q K^T and
// the GEMMs go dV, dK, dQ, so that the next dO streams in during dK + dQ and the next Q during
// dQ + the next dP: one Q/dO buffer each, with the loads still hidden behind MMAs. This frees
// the shared memory for a 128-row query tile at d256 on the H100; at d128 it is the schedule
// whose prefetching GEMMs fit 255 registers without spills (ptxas, sm_80 and sm_90).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_,
          int AtomLayoutMSdP_, int AtomLayoutNdKV_, int AtomLayoutMdQ_, bool kDoubleBuffer_,
          int kDQChunks_ = 1, bool kLeanGemms_ = false, bool kDPFirst_ = false>
struct BwdTraits : BaseTraits<Element_, kHeadDim_, kNWarps_ * 32> {
  using Base = BaseTraits<Element_, kHeadDim_, kNWarps_ * 32>;
  using Element = typename Base::Element;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr bool kDoubleBuffer = kDoubleBuffer_;
  static constexpr int kStages = kDoubleBuffer ? 2 : 1;
  static constexpr int AtomLayoutMSdP = AtomLayoutMSdP_;
  static constexpr int AtomLayoutNdKV = AtomLayoutNdKV_;
  static constexpr int AtomLayoutMdQ = AtomLayoutMdQ_;
  static constexpr int kDQChunks = kDQChunks_;
  static constexpr bool kLeanGemms = kLeanGemms_;
  static constexpr bool kDPFirst = kDPFirst_;
  static_assert(!(kDPFirst && kDoubleBuffer), "kDPFirst is a single-buffered schedule");
  static constexpr int kDQCols = kHeadDim / kDQChunks;
  // A chunk must start on a swizzle-atom column boundary so that it is itself a swizzled K tile.
  static_assert(kDQCols % Base::kBlockKSmem == 0);

  using TiledMmaSdP = TiledMMA<
      typename Base::MmaAtom, Layout<Shape<Int<AtomLayoutMSdP>, Int<kNWarps / AtomLayoutMSdP>, _1>>,
      Tile<Int<16 * AtomLayoutMSdP>, Int<16 * kNWarps / AtomLayoutMSdP>, _16>>;
  using TiledMmadKV = TiledMMA<
      typename Base::MmaAtom, Layout<Shape<Int<AtomLayoutNdKV>, Int<kNWarps / AtomLayoutNdKV>, _1>>,
      Tile<Int<16 * AtomLayoutNdKV>, Int<16 * kNWarps / AtomLayoutNdKV>, _16>>;
  using TiledMmadQ = TiledMMA<
      typename Base::MmaAtom, Layout<Shape<Int<AtomLayoutMdQ>, Int<kNWarps / AtomLayoutMdQ>, _1>>,
      Tile<Int<16 * AtomLayoutMdQ>, Int<16 * kNWarps / AtomLayoutMdQ>, _16>>;

  using SmemLayoutQdO = decltype(tile_to_shape(typename Base::SmemLayoutAtomQKV{},
                                               Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQdOt = decltype(composition(
      SmemLayoutQdO{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutQdOtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQdOt{}));

  using SmemLayoutKV = decltype(tile_to_shape(typename Base::SmemLayoutAtomQKV{},
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  // One dQ column chunk of K^T: [kDQCols, kBlockN], at element offset chunk * kBlockN * kDQCols.
  using SmemLayoutKChunk = decltype(tile_to_shape(typename Base::SmemLayoutAtomQKV{},
                                                  Shape<Int<kBlockN>, Int<kDQCols>>{}));
  using SmemLayoutKtChunk = decltype(composition(
      SmemLayoutKChunk{}, make_layout(Shape<Int<kDQCols>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutKtChunkNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKtChunk{}));

  static constexpr int kPBlockN = kBlockN >= 64 ? 64 : 32;
  using SmemLayoutPdS = decltype(tile_to_shape(typename SmemAtom<kPBlockN>::type{},
                                               Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  static constexpr int kSmemQdO = int(size(SmemLayoutQdO{})) * sizeof(Element);
  static constexpr int kSmemKV = int(size(SmemLayoutKV{})) * sizeof(Element);
  static constexpr int kSmemPdS = int(size(SmemLayoutPdS{})) * sizeof(Element);
  static constexpr int kSmemSize = 2 * kStages * kSmemQdO + 2 * kSmemKV + 2 * kSmemPdS;
  static_assert(kBlockM % Base::kGmemRowsPerPass == 0 && kBlockN % Base::kGmemRowsPerPass == 0);
};

}  // namespace hstu
