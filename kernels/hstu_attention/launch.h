// Grid, shared-memory size and tile configuration per (dtype, head dim); the instantiation files
// include this and instantiate run_hstu_fwd / run_hstu_bwd for one pair each.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "bwd_kernel.h"
#include "bwd_kernel_sm90.h"
#include "fwd_kernel_sm90.h"
#include "fwd_kernel.h"
#include "kernel_traits.h"
#include "launch_registry.h"
#include "params.h"

namespace hstu {

// Forward tiles (kBlockM, kBlockN, warps): register budget of the fp32 S and O fragments.
template <typename T, int D>
struct FwdConfig;
// `two_per_sm` replaces `type` where a block may opt into twice its shared memory (run_hstu_fwd).
template <typename T>
struct FwdConfig<T, 32> {
  using type = FwdTraits<T, 32, 128, 128, 4>;
  using two_per_sm = type;
  using two_per_sm_psmem = type;
};
template <typename T>
struct FwdConfig<T, 64> {
  using type = FwdTraits<T, 64, 128, 128, 4>;
  using two_per_sm = type;
  using two_per_sm_psmem = type;
};
template <typename T>
struct FwdConfig<T, 128> {
  using type = FwdTraits<T, 128, 128, 64, 4>;
  using two_per_sm = type;
  using two_per_sm_psmem = type;
};
template <typename T>
struct FwdConfig<T, 256> {
  using type = FwdTraits<T, 256, 128, 64, 8>;  // 128 KB: one CTA of 8 warps per SM
  // 64 query rows over 4 warps (the same 16-row warp tiles), 96 KB, so two CTAs share an SM and
  // one's barriers and SiLU phases overlap the other's MMAs (the d128 forward runs this way).
  // K/V are loaded from L2 twice as often per MAC.
  using two_per_sm = FwdTraits<T, 256, 64, 64, 4>;
  // H100/H200 (2 x 104 KB): the same CTA with its 4 warps in a 2 x 2 grid: 32 x 32 S tiles and
  // 32 x 128 O tiles per warp read ~28% fewer shared-memory bytes per MAC than 16-row warps
  // (16 x 64 S, 16 x 256 O), for an 8 KB P buffer.
  using two_per_sm_psmem = FwdTraits<T, 256, 64, 64, 4, 2>;
};

// Backward tiles (kBlockM, kBlockN, warps, warp layouts of S/dP, dK/dV, dQ, double-buffered
// Q/dO, dQ column chunks, lean GEMMs, dP-first schedule); `type` fits the A100's 163 KB of shared
// memory per block. `big_smem`, then `huge_smem`, are used instead when the device lets a block
// opt into that much (H100/H200: 227 KB); see run_hstu_bwd.
template <typename T, int D>
struct BwdConfig;
template <typename T>
struct BwdConfig<T, 32> {
  using type = BwdTraits<T, 32, 128, 128, 8, 2, 4, 4, true>;
  using big_smem = type;
  using huge_smem = type;
};
template <typename T>
struct BwdConfig<T, 64> {
  using type = BwdTraits<T, 64, 128, 128, 8, 2, 4, 4, true, 1, true>;
  using big_smem = type;
  using huge_smem = type;
};
template <typename T>
struct BwdConfig<T, 128> {
  // 128 KB, dP-first and single-buffered, with prefetching GEMMs: 255 registers and 0 spills
  // for sm_80 and sm_90 (the double-buffered S-first alternative needs lean GEMMs and still
  // spills 104 bytes). H100, one build: long_d128 backward 225.5-225.9 TF/s vs 214.3-218.6 for it.
  using type = BwdTraits<T, 128, 64, 128, 8, 2, 4, 2, false, 1, false, true>;
  using big_smem = type;
  using huge_smem = type;
};
template <typename T>
struct BwdConfig<T, 256> {
  // 144 KB single-buffered; 208 KB with Q/dO double-buffered. dQ in two 128-column chunks.
  using type = BwdTraits<T, 256, 64, 64, 8, 4, 2, 2, false, 2>;
  using big_smem = BwdTraits<T, 256, 64, 64, 8, 4, 2, 2, true, 2>;
  // 224 KB: 128 query rows x 64 keys, single-buffered with the dP-first schedule. Warp tiles of
  // S/dP grow from 16x32 to 32x32 (8 instead of 5.3 MACs per shared-memory byte) and every
  // barrier covers twice the MMAs; dQ in four 64-column chunks (32 accumulator registers).
  // Prefetching (not lean) GEMMs: 0 spills for sm_90, the only target that has 224 KB.
  using huge_smem = BwdTraits<T, 256, 128, 64, 8, 4, 2, 4, false, 4, false, true>;
};

// The biased backward's tiles where they differ from BwdConfig's: `type` replaces BwdConfig's
// choice when kOverride; `fallback` is used where BwdConfig's smallest tiles plus the bias tables
// exceed the shared-memory budget.
template <typename T, int D>
struct BwdBiasConfig {
  static constexpr bool kOverride = false;
  using fallback = typename BwdConfig<T, D>::type;
};
// d64: the 160 KB double-buffered tiles and the bias tables (34 KB) exceed the A100's 163 KB;
// single-buffered (128 KB) there. The position-only kernel's tables (2 KB, no time term) fit
// beside the double-buffered tiles.
template <typename T>
struct BwdBiasConfig<T, 64> {
  static constexpr bool kOverride = false;
  using fallback = BwdTraits<T, 64, 128, 128, 8, 2, 4, 4, false, 1, true>;
};
// d128: the S-first schedule. The dP-first one keeps the dP fragment live while the bias is
// added to S, and ptxas (sm_90) spills 520 bytes where the S-first one spills 136; measured on
// the H100, the S-first biased backward is 3-4% faster (docs/kernels.md, "Relative attention
// bias in the kernel").
template <typename T>
struct BwdBiasConfig<T, 128> {
  static constexpr bool kOverride = true;
  using type = BwdTraits<T, 128, 64, 128, 8, 2, 4, 2, false, 1, false, false>;
};

constexpr int kMaxDevices = 64;

// A device attribute of the current device (cached per device; 0 if it cannot be read).
template <cudaDeviceAttr kAttr>
inline int device_attribute() {
  static int cached[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
  if (cached[dev] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, kAttr, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    cached[dev] = v;
  }
  return cached[dev];
}

// Checks that the extension has code for the current GPU (else cudaErrorNoKernelImageForDevice /
// cudaErrorInvalidDeviceFunction) and raises the kernel's dynamic smem limit; done once per
// (kernel, device) since these driver calls cost microseconds on every launch otherwise.
// `slots` must be distinct per kernel (all kernels share one function-pointer type): per device,
// how many CTAs of the kernel the whole GPU holds at once (SMs x resident CTAs per SM), 0 until
// prepared. max_shared: ask for the largest shared-memory carveout (for kernels meant to fit two
// CTAs per SM; otherwise the driver may size the carveout for one).
template <typename Kernel>
inline cudaError_t prepare_kernel(Kernel kernel, int threads, int smem, int (&slots)[kMaxDevices],
                                  bool max_shared = false) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices && slots[dev] > 0) return cudaSuccess;
  cudaFuncAttributes attr;
  err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  if (err == cudaSuccess && max_shared) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
  }
  int per_sm = 0;
  if (err == cudaSuccess) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  }
  const int sms = device_attribute<cudaDevAttrMultiProcessorCount>();
  if (err == cudaSuccess && dev >= 0 && dev < kMaxDevices) {
    slots[dev] = per_sm * sms > 0 ? per_sm * sms : 1;
  }
  return err;
}

inline int current_slots(int const (&slots)[kMaxDevices]) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 1;
  return slots[dev] > 0 ? slots[dev] : 1;
}

// Largest dynamic shared memory a block may opt into on the current device.
inline int max_smem_optin() {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
}

// Shared memory the kernels may plan with per block: the device's opt-in limit, capped by the
// environment variable HSTU_ATTN_MAX_SMEM (bytes) when set, e.g. 166912 to run the A100 tiles on
// an H100 (d256: 229375 selects the 64x64 double-buffered backward tiles and keeps the two-CTA
// forward; 166912 the A100's single-buffered backward and one-CTA forward).
inline int smem_budget() {
  int v = max_smem_optin();
  if (const char* e = std::getenv("HSTU_ATTN_MAX_SMEM")) {
    const long cap = std::strtol(e, nullptr, 10);
    if (cap > 0 && cap < v) v = int(cap);
  }
  return v;
}

// Dispatch groups of the 1-D grids (grid_tile_of in utils.h) for n_blocks CTAs per (sequence,
// head) pair, each pair's CTAs streaming per_pair bytes of rows that stay in L2 while the group
// runs:
//  - pairs per group: as many as keep those rows within half the L2, at least one;
//  - the last group (which also takes the remainder) holds at least 2 x slots / n_blocks pairs:
//    a pair's work is ~n_blocks x its heaviest CTA / 2, so the last group's work per slot is then
//    at least one heaviest CTA, and its heaviest CTAs, dispatched first, end with the rest.
// HSTU_ATTN_PAIR_GROUP=<n> and HSTU_ATTN_LAST_GROUP=<n> override the two sizes (a value >= B x H
// gives one group over the whole batch, block-major across all pairs, for comparisons).
// Returns the grid size (0: nothing to launch, -1: too many CTAs for a 1-D grid).
inline int64_t set_grid_order(HstuParams& p, int64_t n_blocks, int64_t per_pair, int slots) {
  const int64_t pairs = int64_t(p.batch) * p.heads;
  const int64_t ctas = n_blocks * pairs;
  if (ctas <= 0) return 0;
  if (ctas > int64_t(0x7fffffff)) return -1;
  auto env = [](const char* name) -> int64_t {
    const char* e = std::getenv(name);
    return e ? std::strtol(e, nullptr, 10) : 0;
  };
  int64_t group = env("HSTU_ATTN_PAIR_GROUP");
  if (group <= 0) {
    const int64_t l2 = device_attribute<cudaDevAttrL2CacheSize>();
    group = per_pair > 0 ? l2 / 2 / per_pair : pairs;
  }
  group = std::min(std::max<int64_t>(group, 1), pairs);
  int64_t last = env("HSTU_ATTN_LAST_GROUP");
  if (last <= 0) last = (2 * int64_t(slots) + n_blocks - 1) / n_blocks;
  last = std::min(std::max(last, group), pairs);
  p.pair_group = int(group);
  p.last_group_first = int((pairs - last) / group * group);
  return ctas;
}

// The compacted grid. A full grid has n_blocks CTAs per (sequence, head) pair, n_blocks sized
// by the longest sequence; a CTA whose block starts past its own sequence's end exits at once,
// but still costs its launch (~0.5 us of an SM, measured on the H100: with heavy-tailed lengths
// three quarters of the d256 grids are such CTAs). compact_grid launches one CTA that lists the
// full grid's tiles that have work, in the full grid's dispatch order (grid_tile_of), in
// p.tile_map; the kernel then runs on a grid of
//   heads x floor((total + batch x (block - 1)) / block)  >=  heads x sum_b ceil(L_b / block)
// CTAs, those past the list's end exiting at once (tile -1). fwd_order: the forward's order ->
// block map (0 first, then n_blocks - order), else the backward's (block = order).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) hstu_compact_grid_kernel(
    const __grid_constant__ HstuParams p, int n_blocks, int block, bool fwd_order, int n_out) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024);
  const int64_t full = int64_t(p.batch) * p.heads * n_blocks;
  const int tid = threadIdx.x;
  constexpr int nt = kThreads;
  const int64_t chunk = (full + nt - 1) / nt;  // each thread lists one run of the full grid
  const int64_t x0 = min(full, int64_t(tid) * chunk);
  const int64_t x1 = min(full, x0 + chunk);
  auto has_work = [&](int64_t x) {
    int order, bidb, bidh;
    grid_tile_of(p, int(x), n_blocks, order, bidb, bidh);
    const int blk = fwd_order ? fwd_block_of_order(order, n_blocks) : order;
    return int64_t(blk) * block < p.cu_seqlens[bidb + 1] - p.cu_seqlens[bidb];
  };
  int count = 0;
  for (int64_t x = x0; x < x1; ++x) count += has_work(x);
  // exclusive scan of the counts over the CTA (warp scans, then the warps' totals)
  __shared__ int warp_total[32];
  __shared__ int listed;
  const int lane = tid & 31, warp = tid >> 5;
  int incl = count;
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int nw = nt >> 5;
    int t = lane < nw ? warp_total[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, t, d);
      if (lane >= d) t += v;
    }
    if (lane < nw) warp_total[lane] = t;  // inclusive over the warps
    if (lane == nw - 1) listed = t;
  }
  __syncthreads();
  int pos = incl - count + (warp > 0 ? warp_total[warp - 1] : 0);
  for (int64_t x = x0; x < x1; ++x) {
    if (has_work(x)) p.tile_map[pos++] = int(x);
  }
  for (int i = listed + tid; i < n_out; i += nt) p.tile_map[i] = -1;
}

// The grid to launch for a full grid of `full` CTAs (n_blocks per pair, blocks of `block` rows):
// the compacted one (the map written first, on the stream) where the caller gave a map
// (compact_grid_ctas(p, kTileMapBlock) ints, enough for any block >= kTileMapBlock) and it
// pays (params.h); else the full grid, p.tile_map cleared. HSTU_ATTN_COMPACT_GRID=0 always
// launches the full grid (for comparisons).
inline int64_t compact_grid(HstuParams& p, int64_t full, int n_blocks, int block, bool fwd_order,
                            cudaStream_t stream) {
  const char* e = std::getenv("HSTU_ATTN_COMPACT_GRID");
  const int64_t compact = compact_grid_ctas(p, block);
  if (p.tile_map == nullptr || (e != nullptr && e[0] == '0') || block < kTileMapBlock ||
      !compact_grid_pays(compact, full)) {
    p.tile_map = nullptr;
    return full;
  }
  hstu_compact_grid_kernel<1024><<<1, 1024, 0, stream>>>(p, n_blocks, block, fwd_order,
                                                         int(compact));
  return compact;
}

// Shared memory of a forward kernel: its tiles, plus the bias tables with kBias.
template <typename Kt, bool kBias>
constexpr int fwd_smem_bytes() {
  return Kt::kSmemSize + (kBias ? BiasSmem<Kt::kBlockM, Kt::kBlockN, false>::kBytes : 0);
}

// Launches a forward kernel of tiles Kt (one CTA per query block) with smem bytes of shared
// memory; two_per_sm: the tiles are meant to fit two CTAs per SM (prepare_kernel's max_shared).
template <typename Kt, typename Kernel>
cudaError_t launch_fwd_grid(Kernel kernel, int smem, int (&slots)[kMaxDevices], HstuParams& p,
                            cudaStream_t stream, bool two_per_sm) {
  // The budget (or its HSTU_ATTN_MAX_SMEM cap) is what the tile choice planned with: a kernel
  // past it is a planning error, reported rather than launched.
  if (smem > smem_budget()) return cudaErrorInvalidConfiguration;
  cudaError_t err = prepare_kernel(kernel, Kt::kNThreads, smem, slots, two_per_sm);
  if (err != cudaSuccess) return err;
  // Each CTA streams its pair's K and V rows; one CTA per query block (of the cached-query
  // layout when q_cu_seqlens is set).
  const int q_len = p.q_cu_seqlens ? p.max_q_seqlen : p.max_seqlen;
  const int n_blocks = (q_len + Kt::kBlockM - 1) / Kt::kBlockM;
  int64_t ctas = set_grid_order(
      p, n_blocks, int64_t(p.max_seqlen) * Kt::kHeadDim * 2 * sizeof(typename Kt::Element),
      current_slots(slots));
  if (ctas == 0) return cudaSuccess;
  if (ctas < 0 || p.num_splits < 1 || p.num_splits > 65535) return cudaErrorInvalidConfiguration;
  // the training layout only (the cached forward's grid has its own row layouts and splits)
  if (p.q_cu_seqlens == nullptr && p.seq_lens == nullptr && p.num_splits == 1) {
    ctas = compact_grid(p, ctas, n_blocks, Kt::kBlockM, true, stream);
  } else {
    p.tile_map = nullptr;
  }
  // gridDim.y: the key splits of a cached forward (1 otherwise)
  kernel<<<dim3(unsigned(ctas), unsigned(p.num_splits)), Kt::kNThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename Kt, bool kBias, bool kTwoPerSm = false>
cudaError_t launch_hstu_fwd_kernel(HstuParams& p, cudaStream_t stream) {
  static int slots[kMaxDevices] = {};
  return launch_fwd_grid<Kt>(&hstu_fwd_kernel<Kt, kBias>, fwd_smem_bytes<Kt, kBias>(), slots, p,
                             stream, kTwoPerSm);
}

// Compute capability of the current device as major * 10 + minor (cached; 0 if unknown).
inline int device_sm() {
  static int cached[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
  if (cached[dev] == 0) {
    cached[dev] = device_attribute<cudaDevAttrComputeCapabilityMajor>() * 10 +
                  device_attribute<cudaDevAttrComputeCapabilityMinor>();
  }
  return cached[dev];
}

// Whether an SM90 (wgmma) kernel may run: the build carries sm_90a code (HSTU_SM90A, set by
// setup.py for HSTU_CUDA_ARCH_LIST "9.0a"), the device is a 9.0 one and the tiles fit the
// shared-memory budget. HSTU_ATTN_SM90=0 turns both SM90 kernels off.
inline bool sm90_usable(int smem) {
  if (device_sm() != 90) return false;
  const char* e = std::getenv("HSTU_ATTN_SM90");
  if (e != nullptr && e[0] == '0') return false;
  return smem <= smem_budget();
}

template <typename T, int D, bool kBias>
cudaError_t run_hstu_fwd(HstuParams& p, cudaStream_t stream) {
#if defined(HSTU_SM90A)
  // The SM90 forward takes the training call (no cache layouts, no key splits).
  if constexpr (!kBias && FwdConfigSm90<T, D>::kEnabled) {
    using Sm90 = typename FwdConfigSm90<T, D>::type;
    if (p.q_cu_seqlens == nullptr && p.seq_lens == nullptr && p.num_splits == 1 &&
        sm90_usable(Sm90::kSmemSize)) {
      static int slots[kMaxDevices] = {};
      return launch_fwd_grid<Sm90>(&hstu_fwd_kernel_sm90<Sm90>, Sm90::kSmemSize, slots, p, stream,
                                   false);
    }
  }
#endif
  using One = typename FwdConfig<T, D>::type;
  using Two = typename FwdConfig<T, D>::two_per_sm;
  using TwoP = typename FwdConfig<T, D>::two_per_sm_psmem;
  if constexpr (!std::is_same_v<Two, TwoP>) {
    if (smem_budget() >= 2 * fwd_smem_bytes<TwoP, kBias>()) {
      return launch_hstu_fwd_kernel<TwoP, kBias, true>(p, stream);
    }
  }
  if constexpr (!std::is_same_v<One, Two>) {
    if (smem_budget() >= 2 * fwd_smem_bytes<Two, kBias>()) {
      return launch_hstu_fwd_kernel<Two, kBias, true>(p, stream);
    }
  }
  return launch_hstu_fwd_kernel<One, kBias>(p, stream);
}

// Shared memory of a backward kernel: its tiles, plus with kBias the bias tables (with kTime the
// time term's too: edges, weights, timestamps, the histogram and the bucket bytes).
template <typename Kt, bool kBias, bool kTime = kBias>
constexpr int bwd_smem_bytes() {
  return Kt::kSmemSize + (kBias ? BiasSmem<Kt::kBlockM, Kt::kBlockN, true, kTime>::kBytes : 0);
}

// Launches a backward kernel of tiles Kt (one CTA per key block) with smem bytes of shared memory.
template <typename Kt, typename Kernel>
cudaError_t launch_bwd_grid(Kernel kernel, int smem, int (&slots)[kMaxDevices], HstuParams& p,
                            cudaStream_t stream) {
  // The budget (or its HSTU_ATTN_MAX_SMEM cap) is what the tile choice planned with: a kernel
  // past it is a planning error, reported rather than launched.
  if (smem > smem_budget()) return cudaErrorInvalidConfiguration;
  cudaError_t err = prepare_kernel(kernel, Kt::kNThreads, smem, slots);
  if (err != cudaSuccess) return err;
  // Each CTA streams its pair's Q and dO rows and reduces into its fp32 dQ accumulator rows.
  const int n_blocks = (p.max_seqlen + Kt::kBlockN - 1) / Kt::kBlockN;
  int64_t ctas = set_grid_order(
      p, n_blocks,
      int64_t(p.max_seqlen) * Kt::kHeadDim * (2 * sizeof(typename Kt::Element) + sizeof(float)),
      current_slots(slots));
  if (ctas == 0) return cudaSuccess;
  if (ctas < 0) return cudaErrorInvalidConfiguration;
  ctas = compact_grid(p, ctas, n_blocks, Kt::kBlockN, false, stream);
  kernel<<<dim3(unsigned(ctas)), Kt::kNThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename Kt, bool kBias, bool kTime = kBias>
cudaError_t launch_hstu_bwd_kernel(HstuParams& p, cudaStream_t stream) {
  static int slots[kMaxDevices] = {};
  return launch_bwd_grid<Kt>(&hstu_bwd_kernel<Kt, kBias, kTime>,
                             bwd_smem_bytes<Kt, kBias, kTime>(), slots, p, stream);
}

// The SM90 backward (bwd_kernel_sm90.h) leaves deterministic mode and the in-kernel dQ
// conversion to the SM80 kernel.
inline bool sm90_bwd_usable(HstuParams const& p, int smem) {
  return !p.deterministic && p.dq_counter == nullptr && sm90_usable(smem);
}

// The largest of the (dtype, head dim)'s backward configurations that the smem budget allows.
// kTime = false: the position-only kernel (the time term compiled out; same tiles).
template <typename T, int D, bool kBias, bool kTime = kBias>
cudaError_t launch_hstu_bwd_config(HstuParams& p, cudaStream_t stream) {
  using Small = typename BwdConfig<T, D>::type;
  using Big = typename BwdConfig<T, D>::big_smem;
  using Huge = typename BwdConfig<T, D>::huge_smem;
  static_assert(Small::kSmemSize <= Big::kSmemSize && Big::kSmemSize <= Huge::kSmemSize);
#if defined(HSTU_SM90A)
  if constexpr (!kBias && BwdConfigSm90<T, D>::kEnabled) {
    using Sm90 = typename BwdConfigSm90<T, D>::type;
    if (sm90_bwd_usable(p, Sm90::kSmemSize)) {
      static int slots[kMaxDevices] = {};
      return launch_bwd_grid<Sm90>(&hstu_bwd_kernel_sm90<Sm90>, Sm90::kSmemSize, slots, p, stream);
    }
  }
#endif
  if constexpr (kBias && BwdBiasConfig<T, D>::kOverride) {
    return launch_hstu_bwd_kernel<typename BwdBiasConfig<T, D>::type, kBias, kTime>(p, stream);
  } else {
    [[maybe_unused]] const int budget = smem_budget();
    // Not with the bias: d256's 224 KB tiles leave no room for the time tables, and the
    // position-only kernel that fits them spills 708 bytes (sm_90a) and measured 34% slower than
    // on the 208 KB tiles (H200, long_d256: 2.86 against 2.13 ms).
    if constexpr (!kBias && !std::is_same_v<Big, Huge>) {
      if (budget >= bwd_smem_bytes<Huge, kBias, kTime>()) {
        return launch_hstu_bwd_kernel<Huge, kBias, kTime>(p, stream);
      }
    }
    if constexpr (!std::is_same_v<Small, Big>) {
      if (budget >= bwd_smem_bytes<Big, kBias, kTime>()) {
        return launch_hstu_bwd_kernel<Big, kBias, kTime>(p, stream);
      }
    }
    if constexpr (kBias) {
      using Fallback = typename BwdBiasConfig<T, D>::fallback;
      if constexpr (!std::is_same_v<Small, Fallback>) {
        if (budget < bwd_smem_bytes<Small, kBias, kTime>()) {
          return launch_hstu_bwd_kernel<Fallback, kBias, kTime>(p, stream);
        }
      }
    }
    return launch_hstu_bwd_kernel<Small, kBias, kTime>(p, stream);
  }
}

// dQ is converted by the backward kernel itself when the caller passes dq_counter (api.cpp does
// only with HSTU_ATTN_DQ_CONVERT=bwd: measured slower on the H100 at d64/d128), else by the
// separate convert kernel below (both are tested).
template <typename T, int D, bool kBias, bool kTime = kBias>
cudaError_t run_hstu_bwd(HstuParams& p, cudaStream_t stream) {
  cudaError_t err = launch_hstu_bwd_config<T, D, kBias, kTime>(p, stream);
  if (err != cudaSuccess) return err;
  const int64_t per_head = int64_t(p.total) * D;
  // With dq_counter the backward kernel has converted dQ itself; without p.dq the caller takes
  // dq_accum as it is.
  const bool converted = p.dq_counter != nullptr && !p.deterministic;
  if (!converted && p.dq != nullptr && per_head > 0 && p.heads > 0) {
    const int threads = 256;
    const int64_t blocks = (per_head / 4 + threads - 1) / threads;
    hstu_convert_dq_kernel<T, D><<<dim3(unsigned(blocks), unsigned(p.heads)), threads, 0, stream>>>(
        p.dq_accum, reinterpret_cast<T*>(p.dq), p.total, p.row_stride, p.head_stride);
    err = cudaGetLastError();
  }
  return err;
}

// One instantiation file per (dtype, head dim, direction, bias kind) registers its launcher at
// load time, so a build filtered with HSTU_KERNEL_DIMS links and reports what is missing at call
// time. KIND is a BiasKind without its k: None, Any (position and/or time) or, for the backward
// only, Position (the time term compiled out).
#define HSTU_REGISTER_FWD(T, DT, D, KIND)                                                  \
  static_assert(::hstu::BiasKind::k##KIND != ::hstu::BiasKind::kPosition,                 \
                "the forward has no position-only kernel");                               \
  namespace {                                                                              \
  const bool hstu_registered_fwd_##D = ::hstu::register_launcher(                          \
      ::hstu::Direction::kFwd, DT, D, ::hstu::BiasKind::k##KIND,                           \
      &::hstu::run_hstu_fwd<T, D, ::hstu::bias_kind_has_bias(::hstu::BiasKind::k##KIND)>); \
  }
#define HSTU_REGISTER_BWD(T, DT, D, KIND)                                                  \
  namespace {                                                                              \
  const bool hstu_registered_bwd_##D = ::hstu::register_launcher(                          \
      ::hstu::Direction::kBwd, DT, D, ::hstu::BiasKind::k##KIND,                           \
      &::hstu::run_hstu_bwd<T, D, ::hstu::bias_kind_has_bias(::hstu::BiasKind::k##KIND),   \
                            ::hstu::bias_kind_has_time(::hstu::BiasKind::k##KIND)>);       \
  }

}  // namespace hstu
