// Hashing and counter-based initialisation shared by every dynamic-embedding kernel.
// Mirrors hstu/embeddings/reference_table.py bit for bit (mix64, bucket_of, init_rows).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#if defined(__CUDACC__)
#define DE_HD __host__ __device__ __forceinline__
#else
#define DE_HD inline
#endif

namespace dynemb {

constexpr int kBucket = 32;  // slots per bucket == warp lanes
constexpr int64_t kEmptyKey = INT64_MIN;  // a free slot; the id INT64_MIN is rejected in Python
constexpr uint64_t kBucketSalt = 0x2545F4914F6CDD1DULL;
constexpr uint64_t kSeedSalt = 0x9E3779B97F4A7C15ULL;

// splitmix64 finaliser: a bijection on 64 bits with full avalanche.
DE_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

DE_HD int64_t bucket_of(int64_t key, int64_t num_buckets) {
  return static_cast<int64_t>((mix64(static_cast<uint64_t>(key) ^ kBucketSalt) &
                               static_cast<uint64_t>(INT64_MAX)) %
                              static_cast<uint64_t>(num_buckets));
}

// Initialiser of new rows: kind 0 uniform(p0, p1), 1 normal(p0, p1) (Box-Muller), 2 truncated
// normal(mean p0, std p1, bounds [p2, p3] in std units; inverse CDF), 3 constant p0.
struct InitParams {
  int kind;
  uint64_t seed_mix;  // mix64(seed + kSeedSalt)
  double p0, p1, p2, p3;
  double cdf_a, cdf_b;  // standard normal CDF at p2, p3 (truncated normal only)
};

// (0, 1) from 24 hash bits of (key, seed, counter): fp32-exact, identical on every device.
DE_HD double uniform01(uint64_t base, uint64_t counter) {
  const uint64_t bits = mix64(base + counter) >> 40;
  return (static_cast<double>(bits) + 0.5) * (1.0 / 16777216.0);
}

#if defined(__CUDACC__)
// Computed in double (not affected by --use_fast_math), rounded once to fp32.
__device__ __forceinline__ float init_value(const InitParams& p, int64_t key, int col) {
  const uint64_t base = mix64(static_cast<uint64_t>(key) ^ p.seed_mix);
  switch (p.kind) {
    case 0:
      return static_cast<float>(p.p0 + (p.p1 - p.p0) * uniform01(base, col));
    case 1: {
      const double u1 = uniform01(base, 2ull * col);
      const double u2 = uniform01(base, 2ull * col + 1);
      const double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
      return static_cast<float>(p.p0 + p.p1 * z);
    }
    case 2: {
      const double q = p.cdf_a + uniform01(base, col) * (p.cdf_b - p.cdf_a);
      double z = 1.4142135623730951 * erfinv(2.0 * q - 1.0);
      z = fmin(fmax(z, p.p2), p.p3);
      return static_cast<float>(p.p0 + p.p1 * z);
    }
    default:
      return static_cast<float>(p.p0);
  }
}

// A key's initial row (columns past dim, the optimizer-state padding, are zeros), written by the
// 32 lanes of a warp together (coalesced): the insert and the hybrid placement kernels share it,
// so both give bit-equal rows.
__device__ __forceinline__ void write_initial_row(float* row, int64_t width, int dim,
                                                  const InitParams& p, int64_t key, int lane) {
  for (int64_t c = lane; c < width; c += 32) {
    row[c] = c < dim ? init_value(p, key, static_cast<int>(c)) : 0.f;
  }
}
#endif  // __CUDACC__

}  // namespace dynemb
