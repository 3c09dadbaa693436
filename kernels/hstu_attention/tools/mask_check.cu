// Host-side exhaustive check of mask.h (built and run by tests/test_attention_compile.py; no GPU).
// For small sequences and every combination of contexts, targets, group size and window it checks
// that the per-row key intervals, the tile skip/full predicates and the block ranges the kernels
// iterate over agree with the element rule valid(i, j), and that the backward's walk visits every
// non-empty tile and every query block (the in-kernel dQ conversion relies on it). It then prints valid(i, j) for a few
// configurations ("M L c t G w causal" + one 0/1 row per query) so that the test can compare
// them with hstu.ops.reference.hstu_attention_mask.
#include <cstdio>

#include "../mask.h"

using hstu::SeqMask;

static int failures = 0;
#define EXPECT(cond, ...)                                                     \
  do {                                                                        \
    if (!(cond) && failures++ < 20) {                                         \
      std::printf("FAIL %s: L=%d c=%d t=%d G=%d w=%d causal=%d ", #cond, mk.L, mk.c, \
                  mk.L - mk.H, mk.G, mk.w, int(mk.causal));                  \
      std::printf(__VA_ARGS__);                                               \
      std::printf("\n");                                                      \
    }                                                                         \
  } while (0)

static void check(const SeqMask& mk) {
  const int L = mk.L;
  for (int i = 0; i < L; ++i) {
    int lo1, hi1, lo2, hi2;
    mk.row_keys(i, lo1, hi1, lo2, hi2);
    EXPECT(mk.valid(i, i), "i=%d", i);
    for (int j = 0; j < L; ++j) {
      const bool in = (j >= lo1 && j < hi1) || (j >= lo2 && j < hi2);
      EXPECT(in == mk.valid(i, j), "i=%d j=%d", i, j);
    }
  }
  const int blocks[][2] = {{4, 4}, {8, 4}, {4, 8}, {16, 16}, {2, 2}};
  for (auto& bs : blocks) {
    const int bm = bs[0], bn = bs[1];
    for (int m0 = 0; m0 < L; m0 += bm) {
      const int m1 = m0 + bm < L ? m0 + bm : L;
      const int klo = mk.row_block_key_lo(m0), khi = mk.row_block_key_hi(m0, m1);
      for (int n0 = 0; n0 < L; n0 += bn) {
        const int n1 = n0 + bn < L ? n0 + bn : L;
        bool any = false, all = true;
        for (int i = m0; i < m1; ++i)
          for (int j = n0; j < n1; ++j) {
            const bool v = mk.valid(i, j);
            any |= v;
            all &= v;
            if (v) {
              EXPECT(j >= klo && j < khi, "row block [%d,%d) misses key %d (row %d)", m0, m1, j, i);
              EXPECT(i >= mk.key_block_row_lo(n0) && i < mk.key_block_row_hi(n0, n1),
                     "key block [%d,%d) misses row %d (key %d)", n0, n1, i, j);
            }
          }
        if (mk.tile_empty(m0, m0 + bm, n0, n0 + bn)) EXPECT(!any, "tile %d,%d empty", m0, n0);
        if (mk.tile_full(m0, m0 + bm, n0, n0 + bn)) EXPECT(all, "tile %d,%d full", m0, n0);
        // The backward's walk visits every tile holding a valid pair.
        if (any) EXPECT(mk.key_block_visits(n0, n1, m0 / bm, bm), "walk skips tile %d,%d", m0, n0);
      }
      // In-kernel dQ conversion: every query block has a key block that visits it (the last of
      // them converts it; none would leave dq unwritten).
      int visitors = 0;
      for (int n0 = 0; n0 < L; n0 += bn)
        visitors += mk.key_block_visits(n0, n0 + bn < L ? n0 + bn : L, m0 / bm, bm);
      EXPECT(visitors >= 1, "query block %d has no visiting key block (bm=%d bn=%d)", m0, bm, bn);
    }
  }
}

int main() {
  long cases = 0;
  for (int L = 0; L <= 24; ++L)
    for (int c = 0; c <= L; ++c)
      for (int t = 0; t + c <= L; ++t)
        for (int G = 1; G <= 4; ++G)
          for (int w = 0; w <= 5; ++w) {
            SeqMask mk{L, c, L - t, G, w, true};
            check(mk);
            ++cases;
          }
  for (int L = 0; L <= 24; ++L) {
    SeqMask mk{L, 0, L, 1, 0, false};
    check(mk);
    ++cases;
  }
  std::printf("CHECKED %ld configurations, %d failures\n", cases, failures);
  const int show[][6] = {{13, 0, 0, 1, 0, 1}, {13, 3, 0, 1, 0, 1}, {13, 0, 4, 1, 0, 1},
                         {13, 2, 5, 2, 0, 1}, {13, 0, 0, 1, 3, 1}, {13, 3, 4, 3, 2, 1},
                         {13, 1, 6, 4, 1, 1}, {13, 0, 0, 1, 0, 0}, {9, 4, 5, 2, 1, 1}};
  for (auto& s : show) {
    SeqMask mk{s[0], s[1], s[0] - s[2], s[3], s[4], s[5] != 0};
    std::printf("M %d %d %d %d %d %d\n", s[0], s[1], s[2], s[3], s[4], s[5]);
    for (int i = 0; i < mk.L; ++i) {
      for (int j = 0; j < mk.L; ++j) std::printf("%d", int(mk.valid(i, j)));
      std::printf("\n");
    }
  }
  return failures == 0 ? 0 : 1;
}
