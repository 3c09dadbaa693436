// The HSTU mask rules of docs/design.md in one place: per element (valid) and per tile (empty / full).
//
// For one sequence of length L with c leading contextual tokens and t trailing targets
// (H = L - t history tokens), ids id(p) = max(p - c + 1, 0) if c > 0 else p, group
// g(p) = (p - H) / G:
//   valid(i, j) = (i == j or id(i) > id(j))
//                 and (not (i >= H and j >= H) or g(i) == g(j))
//                 and (w == 0 or id(i) - id(j) <= w)
//              or (c > 0 and id(i) == 0 and j < H)
// Rows/keys past L never need masking: their q/k/v tiles are zero-filled in shared memory and
// SiLU(0) = 0, so they contribute nothing forward or backward.
#pragma once

namespace hstu {

__host__ __device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

struct SeqMask {
  int L;  // sequence length
  int c;  // contextual tokens (leading)
  int H;  // history length L - num_targets
  int G;  // target group size
  int w;  // local window on ids (0 = none)
  bool causal;

  __host__ __device__ __forceinline__ int id(int p) const { return c > 0 ? (p - c + 1 > 0 ? p - c + 1 : 0) : p; }

  __host__ __device__ __forceinline__ bool valid(int i, int j) const {
    if (!causal) return true;
    const int ii = id(i), ij = id(j);
    bool ok = (i == j) || (ii > ij);
    if (i >= H && j >= H) ok = ok && ((i - H) / G == (j - H) / G);
    if (w > 0) ok = ok && (ii - ij <= w);
    if (c > 0 && ii == 0 && j < H) ok = true;
    return ok;
  }

  // Smallest key any rule lets row i (< L) see; monotone non-decreasing in i.
  __host__ __device__ __forceinline__ int key_lo(int i) const {
    if (!causal || w == 0) return 0;
    if (c > 0 && i < c) return 0;  // contextual rows see all history
    const int lim = id(i) - w;     // keys need id(j) >= lim
    if (lim <= 0) return 0;
    return c > 0 ? lim + c - 1 : lim;
  }

  // The keys row i (< L) sees, as two half-open intervals [lo1, hi1) U [lo2, hi2) (docs/design.md rules
  // solved per row): contextual rows see the history [0, H); other history rows [key_lo, i];
  // target rows the history [key_lo, H) plus their own group's targets up to themselves.
  __host__ __device__ __forceinline__ void row_keys(int i, int& lo1, int& hi1, int& lo2, int& hi2) const {
    lo2 = 0;
    hi2 = 0;
    if (!causal) {
      lo1 = 0;
      hi1 = L;
      return;
    }
    if (c > 0 && i < c) {
      lo1 = 0;
      hi1 = H;
      return;
    }
    lo1 = key_lo(i);
    if (i < H) {
      hi1 = i + 1;
      return;
    }
    hi1 = H;
    lo2 = imax(lo1, H + ((i - H) / G) * G);
    hi2 = i + 1;
  }

  // Key range [lo, hi) of a row block [m0, m1) (m1 clamped to L by the caller).
  __host__ __device__ __forceinline__ int row_block_key_lo(int m0) const { return key_lo(m0); }
  __host__ __device__ __forceinline__ int row_block_key_hi(int m0, int m1) const {
    if (!causal) return L;
    if (c > 0 && m0 < c) return imin(L, imax(H, m1));
    return m1;
  }

  // Row range [lo, hi) that can see a key block [n0, n1) (n1 clamped to L).
  __host__ __device__ __forceinline__ int key_block_row_lo(int n0) const {
    if (!causal) return 0;
    return (c > 0 && n0 < H) ? 0 : n0;
  }
  __host__ __device__ __forceinline__ int key_block_row_hi(int n0, int n1) const {
    if (!causal) return L;
    int hi = L;
    // For rows past the contextual ones key_lo(i) = i - w once the window bites, so rows up to
    // max(n1, c) + w still reach this block.
    if (w > 0) hi = imin(hi, imax(n1, c) + w);
    if (n0 >= H) hi = imin(hi, H + ((n1 - 1 - H) / G + 1) * G);  // only same-group targets
    return hi;
  }

  // The backward's walk: the query blocks (of bm rows) that the CTA of key block [n0, n1) visits
  // are those in [lo, hi) that tile_empty does not rule out. The in-kernel dQ conversion counts
  // the key blocks visiting a query block with the same predicate.
  __host__ __device__ __forceinline__ void key_block_query_blocks(int n0, int n1, int bm, int& lo,
                                                                  int& hi) const {
    lo = key_block_row_lo(n0) / bm;
    hi = (key_block_row_hi(n0, n1) + bm - 1) / bm;
  }
  __host__ __device__ __forceinline__ bool key_block_visits(int n0, int n1, int m, int bm) const {
    int lo, hi;
    key_block_query_blocks(n0, n1, bm, lo, hi);
    return m >= lo && m < hi && !tile_empty(m * bm, (m + 1) * bm, n0, n1);
  }

  // True only if no pair of the tile [m0, m1) x [n0, n1) is valid (conservative).
  __host__ __device__ __forceinline__ bool tile_empty(int m0, int m1, int n0, int n1) const {
    m1 = imin(m1, L);
    n1 = imin(n1, L);
    if (m0 >= m1 || n0 >= n1) return true;
    if (!causal) return false;
    if (c > 0 && m0 < c && n0 < H) return false;
    const int r0 = c > 0 ? imax(m0, c) : m0;  // first non-contextual row
    if (r0 >= m1) return true;
    if (n0 > m1 - 1) return true;             // causal: every key after every row
    if (key_lo(r0) > n1 - 1) return true;    // window (key_lo is monotone)
    if (r0 >= H && n0 >= H) {                 // target rows x target keys: groups must meet
      const int gr0 = (r0 - H) / G, gr1 = (m1 - 1 - H) / G;
      const int gc0 = (n0 - H) / G, gc1 = (n1 - 1 - H) / G;
      if (gr1 < gc0 || gc1 < gr0) return true;
    }
    return false;
  }

  // True only if every in-sequence pair of the tile is valid (so no per-element mask is needed).
  __host__ __device__ __forceinline__ bool tile_full(int m0, int m1, int n0, int n1) const {
    if (!causal) return true;
    m1 = imin(m1, L);
    n1 = imin(n1, L);
    if (m0 >= m1 || n0 >= n1) return true;
    if (c > 0 && m1 <= c) return n1 <= H;  // contextual rows: all history
    if (c > 0 && m0 < c) return false;
    if (n1 - 1 > m0) return false;             // causal
    if (key_lo(m1 - 1) > n0) return false;     // window
    if (n1 > H) return false;                  // target keys: group rule
    return true;
  }
};

}  // namespace hstu
