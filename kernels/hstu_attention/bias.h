// The relative attention bias of docs/design.md, computed inside the kernels from the token
// timestamps and the two weight vectors (no [N, N] tensor anywhere):
//   rab(i, j) = w_pos[clamp(j - i, -P, P) + P] + w_time[bucket(qt(i) - ts(j))]
//   qt(i) = ts(i + 1) for i < L - 1; for the last token last_query_time[b] if given, else ts(L - 1)
//   bucket(g) = the largest k in [0, NB] with edges[k] <= max(|g|, 1),
//               edges[0] = 1, edges[k] = ceil(exp(0.301 k))   (floor(ln|g| / 0.301), exactly)
// The kernels add rab / alpha to S = Q K^T before the mask and the SiLU (alpha S + rab is then
// SiLU's argument); the backward sums dS / alpha (= d rab) per position and per time bucket.
//
// Everything per element comes from shared memory (BiasSmem), filled per CTA or per tile:
//  - the time weights (times 1 / alpha) and the bucket edges, once per CTA;
//  - w_pos / alpha along the tile's kBlockM + kBlockN - 1 diagonals (one value per j - i);
//  - the tile's key timestamps and their range [min, max].
// A query row whose gaps to every key of the tile fall into one bucket (far from the diagonal,
// gaps are large and log buckets wide) takes that bucket's weight without a per-element bucket.
#pragma once

#include <climits>

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "kernel_traits.h"
#include "mask.h"
#include "params.h"

namespace hstu {

using namespace cute;

constexpr int kMaxTimeBuckets = 256;  // api.cpp checks num_buckets against it
// ln(2) / 0.301: log2(x) times this is ln(x) / 0.301.
constexpr float kLog2ToTimeBucket = 0.69314718055994531f / 0.301f;

// Byte offsets of the bias tables in shared memory (after the kernel's own tiles). kBwd adds
// the time gradient's histogram; the backward's key tile is fixed, so it needs one key-timestamp
// buffer where the forward double-buffers them. kTime = false (the position-only backward) gives
// every time table zero bytes: only the diagonals remain.
template <int kBlockM, int kBlockN, bool kBwd, bool kTime = true>
struct BiasSmem {
  static constexpr int kT = kTime ? 1 : 0;  // multiplies the size of every time table
  static constexpr int kDiag = kBlockM + kBlockN;  // floats per diagonal buffer (one spare)
  static constexpr int kKeyBufs = kBwd ? 1 : 2;
  static constexpr int kEdges = 0;                                        // int64 [NB + 1]
  static constexpr int kKeyTs = kEdges + kT * 8 * (kMaxTimeBuckets + 8);  // int64 [bufs][kBlockN]
  // int64 [bufs][3]: the in-sequence keys' min, max, and (forward) 1 if they ascend
  static constexpr int kKeyRange = kKeyTs + kT * 8 * kKeyBufs * kBlockN;
  // The query rows' times (qt above): fixed for the forward's CTA, per tile in the backward.
  static constexpr int kQueryBufs = kBwd ? 2 : 1;
  static constexpr int kQueryTs = kKeyRange + kT * 8 * 3 * kKeyBufs;  // int64 [bufs][kBlockM]
  static constexpr int kTimeW = kQueryTs + kT * 8 * kQueryBufs * kBlockM;  // float [NB + 1]
  static constexpr int kDiagW = kTimeW + kT * 4 * (kMaxTimeBuckets + 4);  // float [2][kDiag]
  // bwd: float [kHistCopies][kHistStride]: the time histogram in 8 copies, chosen by row slot
  // staggered by warp (accumulate_time_grad), so that the shared-memory atomics of a warp's rows,
  // and those of the warps, seldom meet on one word; the copies of a bucket are 4 banks apart.
  static constexpr int kHistCopies = kBwd ? 8 : 0;
  static constexpr int kHistStride = kMaxTimeBuckets + 4;
  static constexpr int kTimeHist = kDiagW + 4 * 2 * kDiag;
  // bwd: the tile's time buckets, written by the recomputed bias for the weight gradient: per
  // row its window code (row_window_code) and, unless the whole key tile has the window's base
  // bucket, one byte per element (buckets of int64 gaps are <= 145: ln(2^63) / 0.301). The row
  // stride keeps 8-byte reads aligned and puts the 8 rows of an MMA fragment's stores in
  // different banks.
  static constexpr int kBucketStride = kBlockN + 8;
  static constexpr int kRowBucket = kTimeHist + kT * 4 * kHistCopies * kHistStride;
  static constexpr int kBuckets = kRowBucket + (kBwd ? kT * 4 * kBlockM : 0);  // uint8 [M][stride]
  static constexpr int kEnd = kBuckets + (kBwd ? kT * kBlockM * kBucketStride : 0);
  static constexpr int kBytes = (kEnd + 127) / 128 * 128;
};

__device__ __forceinline__ int time_bucket(const int64_t* edges, int nb, int64_t g) {
  long long x = g < 0 ? -g : g;
  x = x < 1 ? 1 : x;
  // One MUFU estimate, then one exact correction step against the integer edges (the estimate
  // is within one bucket of floor(ln x / 0.301)).
  // Branch-free (selects), so that unrolled loops over fragments stay one basic block.
  int k = int(__log2f(float(x)) * kLog2ToTimeBucket);
  k = k < 0 ? 0 : (k > nb ? nb : k);
  const int up = (k < nb) & (x >= edges[k < nb ? k + 1 : nb]);
  const int down = (k > 0) & (x < edges[k]);
  return k + up - down;
}

// The time query row i (of a sequence of L tokens) compares with (qt above); rows past L (zero
// filled, masked) take the last token's.
__device__ __forceinline__ int64_t query_time(HstuParams const& p, int bidb, int seq_start, int L,
                                              int i) {
  if (i + 1 < L) return p.timestamps[seq_start + i + 1];
  return p.last_query_time ? p.last_query_time[bidb] : p.timestamps[seq_start + L - 1];
}

// The time buckets of one query row (query time ti) against a key tile whose timestamps lie in
// [kmin, kmax]. All the row's gaps g = ti - t lie on one side of 0 unless the range straddles ti;
// then the buckets span [k0, k0 + n] and, |g| being monotone in t on that side, a key's bucket is
// k0 plus the number of the n thresholds its timestamp passes:
//   gaps >= 0: bucket(ti - t) >= k0 + m  <=>  t <= ti - edges[k0 + m]
//   gaps <= 0: bucket(t - ti) >= k0 + m  <=>  -t <= -ti - edges[k0 + m]
// The backward compares each key's timestamp with the thresholds (exact for any order of the
// keys); the forward, on key tiles in ascending time order, turns them into column segments
// (RowSegments). Rows whose gaps straddle 0 or span more buckets, and the forward's rows of key
// tiles not in ascending order, take the per-key bucket (`general`).
constexpr int kMaxRowThresholds = 2;
struct RowBuckets {
  int k0 = 0;
  int n = 0;             // thresholds in use; n == 0: one bucket for the whole tile
  bool general = false;  // per-key time_bucket
  bool negate = false;   // gaps <= 0: compare -t
  int64_t thr[kMaxRowThresholds] = {};

  // thr[m] for the n thresholds above k0 (ti: the row's query time).
  __device__ __forceinline__ void set_thresholds(const int64_t* edges, int64_t ti) {
    const int64_t base = negate ? -ti : ti;
    CUTE_UNROLL
    for (int m = 0; m < kMaxRowThresholds; ++m) thr[m] = m < n ? base - edges[k0 + m + 1] : 0;
  }

  __device__ __forceinline__ int bucket(int64_t t) const {
    const int64_t x = negate ? -t : t;
    int k = k0;
    CUTE_UNROLL
    for (int m = 0; m < kMaxRowThresholds; ++m) k += int(m < n) & int(x <= thr[m]);
    return k;
  }
};

// The row's k0, n, negate and general (the thresholds are set by the caller).
__device__ __forceinline__ RowBuckets row_buckets(const int64_t* edges, int nb, int64_t ti,
                                                  int64_t kmin, int64_t kmax) {
  RowBuckets rb;
  const int64_t lo = ti - kmax, hi = ti - kmin;  // the row's gaps lie in [lo, hi]
  if (lo < 0 && hi > 0) {
    rb.general = true;
    return rb;
  }
  rb.negate = hi <= 0 && lo < 0;
  const int a = time_bucket(edges, nb, rb.negate ? -hi : lo);
  const int b = time_bucket(edges, nb, rb.negate ? -lo : hi);
  rb.k0 = a;
  rb.n = b - a;
  rb.general = rb.n > kMaxRowThresholds;
  return rb;
}

// How many of the key tile's kBlockN timestamps (ascending) are <= x (strict: < x).
template <int kBlockN, bool kStrict>
__device__ __forceinline__ int count_keys_below(const int64_t* kts, int64_t x) {
  static_assert((kBlockN & (kBlockN - 1)) == 0, "key tiles are a power of two");
  int pos = 0;
  CUTE_UNROLL
  for (int step = kBlockN / 2; step > 0; step /= 2) {
    const int64_t t = kts[pos + step - 1];
    pos += (kStrict ? t < x : t <= x) ? step : 0;
  }
  return pos + ((kStrict ? kts[pos] < x : kts[pos] <= x) ? 1 : 0);
}

// Forward: a row of a key tile in ascending time order whose gaps span at most 3 buckets has
// them constant on 3 column segments [0, lo), [lo, hi), [hi, kBlockN). With gaps >= 0 (keys
// before ti) the bucket falls as the key's time rises (the first segment has k0 + 2, the last
// k0); with gaps <= 0 it rises. The boundaries are the numbers of keys on one side of the
// thresholds (a binary search each), so a key's weight costs two column compares.
// Packed as one word (the quad's lanes exchange it): lo | hi << 8 | k0 << 16 (9 bits) |
// negate << 25, or kGeneral for a row without segments. Unused segments are empty.
struct RowSegments {
  static constexpr uint32_t kGeneral = 1u << 26;
  int lo, hi, k_low, k_mid, k_high;

  __device__ __forceinline__ static uint32_t pack(RowBuckets const& rb, int lo, int hi) {
    return uint32_t(lo) | uint32_t(hi) << 8 | uint32_t(rb.k0) << 16 | uint32_t(rb.negate) << 25;
  }
  // The bucket of each segment, clamped to nb (a clamped value belongs to an empty segment).
  __device__ __forceinline__ static RowSegments unpack(uint32_t code, int nb) {
    RowSegments s;
    s.lo = int(code & 0xffu);
    s.hi = int((code >> 8) & 0xffu);
    const int k0 = int((code >> 16) & 0x1ffu);
    const bool negate = (code >> 25) & 1u;
    const int k2 = k0 + 2 > nb ? nb : k0 + 2;
    s.k_low = negate ? k0 : k2;
    s.k_mid = k0 + 1 > nb ? nb : k0 + 1;
    s.k_high = negate ? k2 : k0;
    return s;
  }
};

// The row's packed segments (RowSegments), or kGeneral.
template <int kBlockN>
__device__ __forceinline__ uint32_t row_segment_code(const int64_t* edges, int nb, int64_t ti,
                                                     const int64_t* kts, int64_t kmin,
                                                     int64_t kmax, bool sorted) {
  static_assert(kBlockN <= 255, "segment boundaries are packed in 8 bits");
  if (!sorted) return RowSegments::kGeneral;
  const RowBuckets rb = row_buckets(edges, nb, ti, kmin, kmax);
  if (rb.general) return RowSegments::kGeneral;
  int lo, hi;
  if (!rb.negate) {  // c < count(t <= ti - edges[k0 + m + 1]) gains 1, m = 0 (hi), 1 (lo)
    hi = rb.n >= 1 ? count_keys_below<kBlockN, false>(kts, ti - edges[rb.k0 + 1]) : 0;
    lo = rb.n >= 2 ? count_keys_below<kBlockN, false>(kts, ti - edges[rb.k0 + 2]) : 0;
  } else {  // c >= count(t < ti + edges[k0 + m + 1]) gains 1, m = 0 (lo), 1 (hi)
    lo = rb.n >= 1 ? count_keys_below<kBlockN, true>(kts, ti + edges[rb.k0 + 1]) : kBlockN;
    hi = rb.n >= 2 ? count_keys_below<kBlockN, true>(kts, ti + edges[rb.k0 + 2]) : kBlockN;
  }
  return RowSegments::pack(rb, lo, hi);
}

// Per-CTA view of the tables; `buf` picks the diagonal / key-timestamp buffer of the tile.
// kTime = false: has_time is the constant false (every time table access is compiled out) and
// the layout has no time tables.
template <int kBlockM, int kBlockN, bool kBwd, bool kTime = true>
struct BiasTables {
  using Layout = BiasSmem<kBlockM, kBlockN, kBwd, kTime>;
  static constexpr bool kIsBwd = kBwd;
  static constexpr int kKeys = kBlockN;  // keys per tile
  char* base;
  bool has_pos, has_time;
  int nb;

  __device__ __forceinline__ int64_t* edges() const {
    return reinterpret_cast<int64_t*>(base + Layout::kEdges);
  }
  __device__ __forceinline__ int64_t* key_ts(int buf) const {
    return reinterpret_cast<int64_t*>(base + Layout::kKeyTs) + buf * kBlockN;
  }
  __device__ __forceinline__ int64_t* key_range(int buf) const {
    return reinterpret_cast<int64_t*>(base + Layout::kKeyRange) + 3 * buf;
  }
  __device__ __forceinline__ int64_t* query_ts(int buf) const {
    return reinterpret_cast<int64_t*>(base + Layout::kQueryTs) + buf * kBlockM;
  }
  __device__ __forceinline__ float* time_w() const {
    return reinterpret_cast<float*>(base + Layout::kTimeW);
  }
  __device__ __forceinline__ float* diag(int buf) const {
    return reinterpret_cast<float*>(base + Layout::kDiagW) + buf * Layout::kDiag;
  }
  __device__ __forceinline__ float* time_hist() const {
    return reinterpret_cast<float*>(base + Layout::kTimeHist);
  }
  __device__ __forceinline__ int* row_bucket() const {
    return reinterpret_cast<int*>(base + Layout::kRowBucket);
  }
  __device__ __forceinline__ uint8_t* buckets() const {
    return reinterpret_cast<uint8_t*>(base + Layout::kBuckets);
  }
};

template <int kBlockM, int kBlockN, bool kBwd, bool kTime = true>
__device__ __forceinline__ BiasTables<kBlockM, kBlockN, kBwd, kTime> bias_tables(
    HstuParams const& p, char* base) {
  BiasTables<kBlockM, kBlockN, kBwd, kTime> t;
  t.base = base;
  t.has_pos = p.pos_w != nullptr;
  t.has_time = kTime && p.time_w != nullptr;
  t.nb = p.num_buckets;
  return t;
}

// Once per CTA (before the first barrier of the main loop): edges, time weights / alpha and, in
// the backward, the zeroed time histogram.
template <int kNThreads, class Tables>
__device__ __forceinline__ void load_bias_constants(HstuParams const& p, int bidh,
                                                    Tables const& t, int tidx, bool bwd) {
  if (t.has_time) {
    const float* w = p.time_w + int64_t(bidh) * p.time_w_head_stride;
    for (int k = tidx; k <= t.nb; k += kNThreads) {
      t.edges()[k] = p.time_edges[k];
      t.time_w()[k] = w[k] * p.inv_alpha;
    }
    if (bwd) {
      constexpr int kHist = Tables::Layout::kHistCopies * Tables::Layout::kHistStride;
      for (int k = tidx; k < kHist; k += kNThreads) t.time_hist()[k] = 0.f;
    }
  }
}

// The tile (m0, n0)'s diagonals: diag[d] = w_pos[clamp(n0 - m0 + d - (kBlockM - 1))] / alpha;
// zeros without a position term (add_rel_bias always adds the diagonal: one code path less).
template <int kBlockM, int kBlockN, int kNThreads, class Tables>
__device__ __forceinline__ void fill_diagonals(HstuParams const& p, int bidh, Tables const& t,
                                               int buf, int m0, int n0, int tidx) {
  if (!t.has_pos) {
    if (!t.has_time) return;
    for (int d = tidx; d < kBlockM + kBlockN - 1; d += kNThreads) t.diag(buf)[d] = 0.f;
    return;
  }
  const float* w = p.pos_w + int64_t(bidh) * p.pos_w_head_stride;
  const int P = p.max_pos;
  float* dst = t.diag(buf);
  for (int d = tidx; d < kBlockM + kBlockN - 1; d += kNThreads) {
    const int rel = n0 - m0 + d - (kBlockM - 1);
    dst[d] = w[(rel < -P ? -P : (rel > P ? P : rel)) + P] * p.inv_alpha;
  }
}

// The key tile [n0, n0 + kBlockN)'s timestamps (keys past L read the last token's), and the
// range of the keys inside the sequence and, for the forward's segments, whether they ascend.
// Warp 0 does it all from one load per key (independent loads, then shuffles: its latency is on
// the way to the next barrier while the other warps compute).
template <int kBlockN, int kNThreads, class Tables>
__device__ __forceinline__ void fill_key_timestamps(HstuParams const& p, Tables const& t, int buf,
                                                    int seq_start, int L, int n0, int tidx) {
  static_assert(kBlockN % 32 == 0, "key tiles are whole warps");
  if (!t.has_time || tidx >= 32) return;
  constexpr int kPer = kBlockN / 32;
  const int64_t* ts = p.timestamps + seq_start;
  int64_t* dst = t.key_ts(buf);
  const int n = imin(kBlockN, L - n0);
  long long v[kPer];
  CUTE_UNROLL
  for (int u = 0; u < kPer; ++u) v[u] = ts[imin(n0 + tidx + 32 * u, L - 1)];
  long long lo = LLONG_MAX, hi = LLONG_MIN;
  bool ascending = true;
  CUTE_UNROLL
  for (int u = 0; u < kPer; ++u) {
    const int c = tidx + 32 * u;
    dst[c] = v[u];
    if (c < n) {
      lo = v[u] < lo ? v[u] : lo;
      hi = v[u] > hi ? v[u] : hi;
    }
    if constexpr (!Tables::kIsBwd) {
      // The next key's timestamp: the next lane's, or the next chunk's first.
      const long long down = __shfl_down_sync(0xffffffffu, v[u], 1);
      const long long first = __shfl_sync(0xffffffffu, v[u + 1 < kPer ? u + 1 : u], 0);
      if (c + 1 < n) ascending &= v[u] <= (tidx < 31 ? down : first);
    }
  }
  CUTE_UNROLL
  for (int s = 16; s > 0; s >>= 1) {
    const long long a = __shfl_xor_sync(0xffffffffu, lo, s);
    const long long b = __shfl_xor_sync(0xffffffffu, hi, s);
    lo = a < lo ? a : lo;
    hi = b > hi ? b : hi;
  }
  if (!Tables::kIsBwd) ascending = __all_sync(0xffffffffu, ascending);
  if (tidx == 0) {
    t.key_range(buf)[0] = lo;
    t.key_range(buf)[1] = hi;
    if (!Tables::kIsBwd) t.key_range(buf)[2] = ascending ? 1 : 0;
  }
}

// The query rows [m0, m0 + kBlockM)'s times into query_ts(buf).
template <int kBlockM, int kNThreads, class Tables>
__device__ __forceinline__ void fill_query_times(HstuParams const& p, Tables const& t, int buf,
                                                 int bidb, int seq_start, int L, int m0,
                                                 int tidx) {
  if (!t.has_time) return;
  for (int r = tidx; r < kBlockM; r += kNThreads) {
    t.query_ts(buf)[r] = query_time(p, bidb, seq_start, L, m0 + r);
  }
}

// Backward: what the time-gradient pass needs of a row (row_bucket()): the base k0 of its
// window of buckets [k0, k0 + 3) and whether its buckets are in buckets() (one byte per key) or
// all k0. A row whose gaps span at most 3 buckets has them all in the window. A `general` row
// (near the diagonal) takes the 3 buckets of its largest gaps, those of the keys farthest away
// (most of its keys on a log scale: `far_bucket`), and adds the rest as runs of equal buckets.
constexpr int kWindow = 3;
constexpr int kNoRow = 0x1000;  // a base past every bucket
constexpr int kRowBytes = 1 << 16;
__device__ __forceinline__ int row_window_code(RowBuckets const& rb, int far_bucket) {
  if (rb.general) return (far_bucket > kWindow - 1 ? far_bucket - (kWindow - 1) : 0) | kRowBytes;
  return rb.k0 | (rb.n > 0 ? kRowBytes : 0);
}

// acc(i, j) += rab(m0 + i, n0 + j) / alpha over an m16n8k16 accumulator fragment
// (((2,2), MMA_M, MMA_N)); tScS holds each element's (row, col) in the tile. `diag_buf` /
// `key_buf` / `query_buf` select the tile's filled buffers (diagonals, key and query times).
// kInit: acc(i, j) = rab / alpha instead (every element is written), the forward's score
// accumulator before its GEMM (docs/kernels.md: the backward measured slower that way).
template <int kBlockM, bool kInit = false, class Tables, class CoordT, class Acc>
__device__ __forceinline__ void add_rel_bias(Tables const& t, int diag_buf, int key_buf,
                                             int query_buf, CoordT const& tScS, Acc& acc) {
  // Row by row (one row's keys at a time keeps few loaded values live: the fragments already
  // hold most registers), with the choices (terms present, a row's buckets) taken outside the
  // element loops: a branch per element would split them into basic blocks and serialise the
  // shared-memory loads.
  constexpr bool kBwd = Tables::kIsBwd;
  constexpr int kBlockN = Tables::kKeys;
  const float* diag = t.diag(diag_buf);
  const int64_t* kts = t.key_ts(key_buf);
  const int64_t* edges = t.edges();
  const float* tw = t.time_w();
  const int64_t kmin = t.has_time ? t.key_range(key_buf)[0] : 0;
  const int64_t kmax = t.has_time ? t.key_range(key_buf)[1] : 0;
  // The modes of a row: Uniform (no time term, or one bucket for the whole key tile: w_row),
  // Thresholds (backward: RowBuckets' int64 compares per key), Segments (forward: RowSegments'
  // two column compares per key), PerKey (time_bucket per key). The diagonal term is always
  // added (zeros without a position term): each mode is a copy of the unrolled loop, and fewer
  // copies keep the main loop in the instruction cache. The backward keeps the buckets for the
  // time gradient (row_bucket(), buckets()). Its registers are all taken (dK, dV and S live):
  // the forward's segments measured 4-7% slower there, so it keeps the thresholds.
  [[maybe_unused]] uint8_t* bkt = nullptr;
  if constexpr (kBwd) bkt = t.buckets();
  auto row_pass = [&](int mi, int r, int row, auto mode, RowBuckets const& rbk,
                      RowSegments const& sg, int64_t ti, float w_row, float w_low, float w_mid) {
    constexpr int kMode = decltype(mode)::value;
    CUTE_UNROLL
    for (int ni = 0; ni < size<2>(acc); ++ni) {
      // The pair's columns are adjacent, the first even (m16n8 accumulator layout).
      int k[2] = {0, 0};
      CUTE_UNROLL
      for (int cc = 0; cc < 2; ++cc) {
        const int col = get<1>(tScS(make_coord(cc, r), mi, ni));
        float w = w_row;  // Segments: the last segment's weight
        if constexpr (kMode == 1) {
          k[cc] = rbk.bucket(kts[col]);
          w = tw[k[cc]];
        }
        if constexpr (kMode == 2) {
          k[cc] = time_bucket(edges, t.nb, ti - kts[col]);
          w = tw[k[cc]];
        }
        if constexpr (kMode == 3) {
          w = col < sg.hi ? w_mid : w;
          w = col < sg.lo ? w_low : w;
        }
        acc(make_coord(cc, r), mi, ni) += w;
      }
      if constexpr (kBwd && (kMode == 1 || kMode == 2)) {
        const int col = get<1>(tScS(make_coord(0, r), mi, ni));
        *reinterpret_cast<uint16_t*>(bkt + row * Tables::Layout::kBucketStride + col) =
            uint16_t(k[0] | (k[1] << 8));
      }
    }
  };
  // The position term first, over the whole fragment without a branch (kInit: it initialises
  // every element): the elements of one diagonal j - i read one shared-memory word, and with no
  // branch between a thread's rows the compiler loads it once for all of them (a thread's rows
  // are 8 or 16 apart, its columns 8 apart, so its diagonals repeat across rows).
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const float d = diag[get<1>(tScS(i)) - get<0>(tScS(i)) + kBlockM - 1];
    if constexpr (kInit) {
      acc(i) = d;
    } else {
      acc(i) += d;
    }
  }
  if (!t.has_time) return;
  using Uniform = cute::C<0>;
  using Thresholds = cute::C<1>;
  using PerKey = cute::C<2>;
  using Segments = cute::C<3>;
  // A thread's rows: (mi, r) -> j = 2 mi + r. The 4 lanes of a quad hold the same rows (m16n8
  // layout), so each lane classifies every 4th row (row_buckets: two buckets, each a MUFU log
  // and edge compares; forward: a binary search per segment boundary) and the quad exchanges
  // one code word per row; the backward rebuilds the thresholds from it with two edge loads.
  constexpr int kRows = 2 * decltype(size<1>(acc))::value;
  constexpr int kOwn = (kRows + 3) / 4;
  const int quad_lane = threadIdx.x % 4;
  const int quad_base = (threadIdx.x % 32) & ~3;
  uint32_t own_code[kOwn];
  if (t.has_time) {
    // The forward's key tile order (fill_key_timestamps; the backward does not check it).
    const bool sorted = !kBwd && t.key_range(key_buf)[2] != 0;
    CUTE_UNROLL
    for (int o = 0; o < kOwn; ++o) {
      own_code[o] = 0;
      const int j = 4 * o + quad_lane;
      if (j < kRows) {
        const int row = get<0>(tScS(make_coord(0, j % 2), j / 2, 0));
        const int64_t ti = t.query_ts(query_buf)[row];
        if constexpr (kBwd) {
          const RowBuckets rb = row_buckets(edges, t.nb, ti, kmin, kmax);
          own_code[o] = uint32_t(rb.k0) | uint32_t(rb.n < 3 ? rb.n : 3) << 16 |
                        uint32_t(rb.general) << 20 | uint32_t(rb.negate) << 21;
          // A general row's largest |gap|, to the first or the last key.
          const int64_t far = ti - kmin > kmax - ti ? ti - kmin : kmax - ti;
          t.row_bucket()[row] =
              row_window_code(rb, rb.general ? time_bucket(edges, t.nb, far) : 0);
        } else {
          own_code[o] = row_segment_code<kBlockN>(edges, t.nb, ti, kts, kmin, kmax, sorted);
        }
      }
    }
  }
  CUTE_UNROLL
  for (int mi = 0; mi < size<1>(acc); ++mi) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int j = 2 * mi + r;
      const int row = get<0>(tScS(make_coord(0, r), mi, 0));
      RowBuckets rbk;
      RowSegments sg{0, 0, 0, 0, 0};
      int64_t ti = 0;
      float w_row = 0.f, w_low = 0.f, w_mid = 0.f;
      if constexpr (kBwd) {
        if (t.has_time) {
          const uint32_t code = __shfl_sync(0xffffffffu, own_code[j / 4], quad_base | (j % 4));
          rbk.k0 = int(code & 0xffffu);
          rbk.n = int((code >> 16) & 0xfu);
          rbk.general = (code >> 20) & 1u;
          rbk.negate = (code >> 21) & 1u;
          if (rbk.general || rbk.n > 0) ti = t.query_ts(query_buf)[row];
          if (!rbk.general && rbk.n > 0) rbk.set_thresholds(edges, ti);
          if (!rbk.general && rbk.n == 0) w_row = tw[rbk.k0];
        }
        if (!t.has_time || (!rbk.general && rbk.n == 0)) {
          row_pass(mi, r, row, Uniform{}, rbk, sg, ti, w_row, 0.f, 0.f);
        } else if (!rbk.general) {
          row_pass(mi, r, row, Thresholds{}, rbk, sg, ti, 0.f, 0.f, 0.f);
        } else {
          row_pass(mi, r, row, PerKey{}, rbk, sg, ti, 0.f, 0.f, 0.f);
        }
      } else {
        bool general = false, one = true;
        if (t.has_time) {
          const uint32_t code = __shfl_sync(0xffffffffu, own_code[j / 4], quad_base | (j % 4));
          general = code & RowSegments::kGeneral;
          if (general) {
            ti = t.query_ts(query_buf)[row];
          } else {
            sg = RowSegments::unpack(code, t.nb);
            w_low = tw[sg.k_low];
            w_mid = tw[sg.k_mid];
            w_row = tw[sg.k_high];
            // One non-empty segment: [0, kBlockN) is [hi, ..), [.., lo) or [lo, hi).
            one = sg.hi == 0 || sg.lo == kBlockN || (sg.lo == 0 && sg.hi == kBlockN);
            if (one) w_row = sg.hi == 0 ? w_row : (sg.lo == kBlockN ? w_low : w_mid);
          }
        }
        // Uniform when every row of the warp's slice is (a choice the whole warp takes alike:
        // the 8 quads' rows differ, and a per-lane choice would run both copies).
        if (!t.has_time || __all_sync(0xffffffffu, !general && one)) {
          row_pass(mi, r, row, Uniform{}, rbk, sg, ti, w_row, 0.f, 0.f);
        } else if (!general) {
          row_pass(mi, r, row, Segments{}, rbk, sg, ti, w_row, w_low, w_mid);
        } else {
          row_pass(mi, r, row, PerKey{}, rbk, sg, ti, 0.f, 0.f, 0.f);
        }
      }
    }
  }
}

// Backward, time term: the tile's dS (staged in shared memory as Element, masked entries 0;
// dS = alpha d rab) summed into time_hist()[bucket] (the whole CTA's; flushed once by
// flush_time_hist). The buckets come from the recomputed bias (add_rel_bias): per row a window
// of 3 buckets [base, base + 3) and, unless the whole key tile has bucket base, one byte per
// element (row_window_code). Each thread walks a segment of one row (16-byte reads of dS,
// 8-byte reads of buckets) and keeps one sum per bucket of the window, with selects: no branch
// between rows of different buckets. The row's threads, or the whole warp when its rows share
// the base (the common case away from the diagonal), reduce the sums by shuffles, and one lane
// per bucket adds its sum to the histogram. A float atomic on shared memory is a
// compare-and-swap loop (SASS ATOMS.CAST.SPIN on sm_80 and sm_90), so lanes adding to one word
// take turns: one atomic per thread made the long_d128 backward 12% slower. Only the keys of a
// `general` row outside its window (near the diagonal) are added per run of equal buckets, one
// atomic per run (into shared memory: the same adds sent to global memory as reductions
// measured 2.4x slower, all CTAs hitting the same few words).
template <int kBlockM, int kBlockN, int kNThreads, class Tables, class SdS>
__device__ __forceinline__ void accumulate_time_grad(Tables const& t, SdS const& sdS, int L,
                                                     int m0, int n0, int tidx) {
  if (!t.has_time) return;
  using Element = typename SdS::value_type;
  constexpr int kSegs = kNThreads >= kBlockM ? kNThreads / kBlockM : 1;
  constexpr int kRowsPerPass = kNThreads / kSegs;
  constexpr int kCols = kBlockN / kSegs;
  constexpr int kStride = Tables::Layout::kBucketStride;
  static_assert(kNThreads % kSegs == 0 && kBlockN % kSegs == 0 && kCols % 8 == 0);
  // A row's kSegs threads are adjacent lanes of one warp.
  static_assert((kSegs & (kSegs - 1)) == 0 && kSegs <= 32 && kNThreads % 32 == 0);
  // The thread's copy of the histogram: its row slot's, staggered by warp (slot + warp), so that
  // a warp's rows take different copies and so do the warps' window sums (added by a warp's
  // first lanes, all of one slot, when its rows share the bucket).
  constexpr int kSlotsPerWarp = 32 / kSegs;
  const int slot = tidx / kSegs;
  float* s_time = t.time_hist() + (slot + slot / kSlotsPerWarp) % Tables::Layout::kHistCopies *
                                      Tables::Layout::kHistStride;
  const uint8_t* bkt = t.buckets();
  const int seg = tidx % kSegs;
  const int lane = tidx % 32;
  const int c_begin = seg * kCols;
  const int c_end = imin(c_begin + kCols, L - n0);
  const int rows = imin(kBlockM, L - m0);
  // Every lane takes every pass (the warp's shuffles), with or without a row.
  for (int pass = 0; pass < kBlockM; pass += kRowsPerPass) {
    const int row = pass + tidx / kSegs;
    const bool has_row = row < rows;
    const int code = has_row ? t.row_bucket()[row] : kNoRow;
    const int base = code & 0xffff;
    const bool bytes = (code & kRowBytes) != 0;
    // The sums of the window's buckets base, base + 1, base + 2.
    float s[kWindow] = {0.f, 0.f, 0.f};
    int run_k = -1;
    float run_sum = 0.f;
    if (has_row) {
      for (int c0 = c_begin; c0 < c_end; c0 += 8) {
        cutlass::Array<Element, 8> raw;
        *reinterpret_cast<uint4*>(&raw) = *reinterpret_cast<const uint4*>(&sdS(row, c0));
        const auto vals = cutlass::NumericArrayConverter<float, Element, 8>{}(raw);
        if (!bytes) {
          CUTE_UNROLL
          for (int e = 0; e < 8; ++e) s[0] += vals[e];
        } else {
          const uint2 kb = *reinterpret_cast<const uint2*>(bkt + row * kStride + c0);
          CUTE_UNROLL
          for (int e = 0; e < 8; ++e) {
            const int k = int(((e < 4 ? kb.x : kb.y) >> (8 * (e % 4))) & 0xffu);
            const int d = k - base;
            CUTE_UNROLL
            for (int w = 0; w < kWindow; ++w) s[w] += d == w ? vals[e] : 0.f;
            if (d < 0 || d >= kWindow) {  // general rows only: keys outside the window
              if (k != run_k) {
                if (run_k >= 0 && run_sum != 0.f) atomicAdd(s_time + run_k, run_sum);
                run_k = k;
                run_sum = vals[e];
              } else {
                run_sum += vals[e];
              }
            }
          }
        }
      }
    }
    if (run_k >= 0 && run_sum != 0.f) atomicAdd(s_time + run_k, run_sum);
    // The window sums: by warp when its rows share the base, else by row.
    const unsigned with = __ballot_sync(0xffffffffu, has_row);
    if (with == 0u) continue;
    const int lead = __ffs(int(with)) - 1;
    const int base_lead = __shfl_sync(0xffffffffu, base, lead);
    // Rows of one bucket have s[1] = s[2] = 0: skip their shuffles when the whole warp's are.
    const bool one = !__any_sync(0xffffffffu, bytes);
    const bool shared = __all_sync(0xffffffffu, !has_row || base == base_lead);
    CUTE_UNROLL
    for (int w = 0; w < kWindow; ++w) {
      if (w > 0 && one) break;
      CUTE_UNROLL
      for (int o = shared ? 16 : kSegs / 2; o > 0; o >>= 1) {
        s[w] += __shfl_xor_sync(0xffffffffu, s[w], o);
      }
    }
    // One lane per bucket of the window: lanes 0-2 of the warp, or of the row's threads.
    const int w = shared ? lane : seg;
    const int k_base = shared ? base_lead : base;
    const float v = w == 0 ? s[0] : (w == 1 ? s[1] : s[2]);
    if ((shared || has_row) && w < (one ? 1 : kWindow) && v != 0.f) {
      atomicAdd(s_time + k_base + w, v);
    }
    if constexpr (kSegs < kWindow) {  // fewer threads per row than buckets in the window
      if (!shared && has_row && !one) {
        CUTE_UNROLL
        for (int x = seg + kSegs; x < kWindow; x += kSegs) {
          const float vx = x == 1 ? s[1] : s[2];
          if (vx != 0.f) atomicAdd(s_time + base + x, vx);
        }
      }
    }
  }
}

// Backward, position term: d w_pos[clamp(j - i)] += the tile (m0, n0)'s dS summed along each
// diagonal j - i, / alpha: one thread per diagonal walks it in shared memory (a warp reads
// consecutive keys of one row: no bank conflicts), 8 rows at a time into 4 partial sums, and
// adds its sum with one global atomic. The element offsets are computed from the dS tile's
// layout (SmemLayoutPdS: 8 x 64 atoms XOR-swizzled in 8-element chunks, tiled column-major)
// with the row within the atom a constant of the unrolled step: ~5 integer operations per
// element where the generic layout arithmetic took ~15 (tests compare the gradient with the
// reference at every head dim).
template <int kBlockM, int kBlockN, int kNThreads, class SdS>
__device__ __forceinline__ void accumulate_pos_grad(HstuParams const& p, int bidh, SdS const& sdS,
                                                    int L, int m0, int n0, int tidx) {
  static_assert(std::is_same_v<typename SdS::layout_type,
                               decltype(tile_to_shape(typename SmemAtom<64>::type{},
                                                      Shape<Int<kBlockM>, Int<kBlockN>>{}))>,
                "the offsets below are those of 8 x 64 swizzled atoms, tiled column-major");
  if (p.pos_w == nullptr) return;
  using Element = typename SdS::value_type;
  const Element* ds = &sdS(0, 0);
  float* dst = p.dpos_w + int64_t(bidh) * p.pos_w_head_stride;
  const int P = p.max_pos;
  const int rows = imin(kBlockM, L - m0), cols = imin(kBlockN, L - n0);
  for (int d = tidx; d < kBlockM + kBlockN - 1; d += kNThreads) {
    const int off = d - (kBlockM - 1);  // col - row on this diagonal
    const int r_begin = imax(0, -off), r_end = imin(rows, cols - off);
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int a = r_begin / 8; 8 * a < r_end; ++a) {  // rows [8a, 8a + 8): one atom row
      CUTE_UNROLL
      for (int u = 0; u < 8; ++u) {
        const int r = 8 * a + u, c = r + off;
        // atom (a, c / 64) of the column-major atom grid, then row u, swizzled column
        const int idx = (a + (kBlockM / 8) * (c >> 6)) * 512 + 64 * u + ((c & 63) ^ (8 * u));
        // Rows off the diagonal's range read element 0 and add nothing: no branch, so the 8
        // loads issue together (a branch per element serialised them).
        const bool in = r >= r_begin && r < r_end;
        const float v = float(ds[in ? idx : 0]);
        s[u % 4] += in ? v : 0.f;
      }
    }
    const float sum = (s[0] + s[1]) + (s[2] + s[3]);
    if (sum != 0.f) {
      const int rel = n0 - m0 + off;
      atomicAdd(dst + (rel < -P ? -P : (rel > P ? P : rel)) + P, sum * p.inv_alpha);
    }
  }
}

template <int kNThreads, class Tables>
__device__ __forceinline__ void flush_time_hist(HstuParams const& p, int bidh, Tables const& t,
                                                int tidx) {
  float* dst = p.dtime_w + int64_t(bidh) * p.time_w_head_stride;
  for (int k = tidx; k <= p.num_buckets; k += kNThreads) {
    float v = 0.f;
    CUTE_UNROLL
    for (int c = 0; c < Tables::Layout::kHistCopies; ++c) {
      v += t.time_hist()[c * Tables::Layout::kHistStride + k];
    }
    if (v != 0.f) atomicAdd(dst + k, v * p.inv_alpha);
  }
}

}  // namespace hstu
