// Counter-based dropout mask: Philox4x32-10 (Salmon et al., SC'11), host + device.
//
// The mask of a [rows, cols] tensor is a pure function of (seed, offset, row, col), so the
// backward regenerates the forward's mask instead of storing it. One Philox call per 8-element
// chunk: counter = (chunk lo, chunk hi, offset lo, offset hi) with chunk = row * (cols / 8) +
// col / 8, key = (seed lo, seed hi) (seed and offset: the CUDA generator's, as torch's own
// dropout uses them); its four 32-bit outputs split into eight 16-bit draws r_0..r_7
// (word j / 2, low half for even j). Element j of the chunk is kept iff r_j >= threshold, where
// threshold = round(p * 65536) (p quantised to 1/65536); kept elements are scaled by
// 65536 / (65536 - threshold), so the expectation is exact. hstu/modules/layer_norm_mul_dropout.py
// has the same function in NumPy (the test oracle).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LNMD_HD __host__ __device__ __forceinline__
#else
#define LNMD_HD inline
#endif

namespace lnmd {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

struct Philox4 {
  uint32_t v[4];
};

LNMD_HD void mulhilo(uint32_t a, uint32_t b, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  const uint64_t prod = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  lo = static_cast<uint32_t>(prod);
  hi = static_cast<uint32_t>(prod >> 32);
#endif
}

LNMD_HD Philox4 philox4x32_10(uint64_t counter_lo, uint64_t counter_hi, uint64_t seed) {
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t lo0, hi0, lo1, hi1;
    mulhilo(kPhiloxM0, c0, lo0, hi0);
    mulhilo(kPhiloxM1, c2, lo1, hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Bit j (0..7) set iff element j of chunk `chunk` is kept at this threshold.
LNMD_HD uint32_t keep_bits(uint64_t chunk, uint64_t seed, uint64_t offset, uint32_t threshold) {
  const Philox4 r = philox4x32_10(chunk, offset, seed);
  uint32_t bits = 0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t r16 = (r.v[j >> 1] >> ((j & 1) * 16)) & 0xFFFFu;
    bits |= static_cast<uint32_t>(r16 >= threshold) << j;
  }
  return bits;
}

}  // namespace lnmd
