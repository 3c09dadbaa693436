// Lookup gather and the fused backward: per-unique-id gradient reduction + optimizer update.
// Rows are padded to a multiple of 4 floats (width), so dim % 4 == 0 tables move float4s.
#include "launch.h"

namespace dynemb {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256;

inline int grid_for(int64_t work_items, int per_block, int max_blocks = 65535 * 8) {
  int64_t g = (work_items + per_block - 1) / per_block;
  if (g < 1) g = 1;
  if (g > max_blocks) g = max_blocks;
  return static_cast<int>(g);
}

template <int VEC>
struct Vec;
template <>
struct Vec<1> {
  float v[1];
  __device__ __forceinline__ void load(const float* p) { v[0] = *p; }
  __device__ __forceinline__ void store(float* p) const { *p = v[0]; }
};
template <>
struct Vec<4> {
  float v[4];
  __device__ __forceinline__ void load(const float* p) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
  }
  __device__ __forceinline__ void store(float* p) const {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};

template <int VEC>
__global__ void __launch_bounds__(kThreads) gather_kernel(
    const float* __restrict__ values, int64_t width, int dim, const int64_t* __restrict__ slots,
    const int64_t* __restrict__ inverse, int64_t n, float* __restrict__ out) {
  const int per_row = dim / VEC;
  const int64_t total = n * per_row;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = t / per_row;
    const int c = static_cast<int>(t - i * per_row) * VEC;
    const int64_t s = slots[inverse[i]];
    Vec<VEC> x;
    if (s >= 0) {
      x.load(values + s * width + c);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) x.v[e] = 0.f;
    }
    x.store(out + i * dim + c);
  }
}

// Summed gradient of columns [c, c + VEC) over the occurrences of one unique id.
template <int VEC>
__device__ __forceinline__ Vec<VEC> reduce_grad(const float* __restrict__ grad, int dim,
                                                const int64_t* __restrict__ perm, int64_t lo,
                                                int64_t hi, int c) {
  Vec<VEC> g;
#pragma unroll
  for (int e = 0; e < VEC; ++e) g.v[e] = 0.f;
  for (int64_t j = lo; j < hi; ++j) {
    Vec<VEC> x;
    x.load(grad + perm[j] * dim + c);
#pragma unroll
    for (int e = 0; e < VEC; ++e) g.v[e] += x.v[e];
  }
  return g;
}

// One warp per unique id. The sum over duplicates happens in registers before the single update,
// so duplicated ids lose nothing and no atomics are needed.
template <int OPT, int VEC>
__global__ void __launch_bounds__(kThreads) update_kernel(
    float* __restrict__ values, int64_t width, int dim, const int64_t* __restrict__ keys,
    const int64_t* __restrict__ uniq, const int64_t* __restrict__ slots,
    const int64_t* __restrict__ perm, const int64_t* __restrict__ offsets,
    const float* __restrict__ grad, int64_t num_unique, OptParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t u = warp; u < num_unique; u += num_warps) {
    const int64_t s = slots[u];
    if (s < 0 || keys[s] != uniq[u]) continue;  // overflowed, or evicted since the forward
    const int64_t lo = offsets[u], hi = offsets[u + 1];
    float* row = values + s * width;
    if (OPT == 0) {  // SGD
      for (int c = lane * VEC; c < dim; c += 32 * VEC) {
        Vec<VEC> g = reduce_grad<VEC>(grad, dim, perm, lo, hi, c);
        Vec<VEC> w;
        w.load(row + c);
#pragma unroll
        for (int e = 0; e < VEC; ++e) w.v[e] -= p.lr * (g.v[e] + p.weight_decay * w.v[e]);
        w.store(row + c);
      }
    } else if (OPT == 1) {  // Adam, decoupled weight decay, per-row step in column 3 * dim
      const float t = row[3 * dim] + 1.f;
      const float bc1 = static_cast<float>(1.0 - pow(static_cast<double>(p.beta1), (double)t));
      const float bc2 = static_cast<float>(1.0 - pow(static_cast<double>(p.beta2), (double)t));
      for (int c = lane * VEC; c < dim; c += 32 * VEC) {
        Vec<VEC> g = reduce_grad<VEC>(grad, dim, perm, lo, hi, c);
        Vec<VEC> w, m, v;
        w.load(row + c);
        m.load(row + dim + c);
        v.load(row + 2 * dim + c);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          m.v[e] = p.beta1 * m.v[e] + (1.f - p.beta1) * g.v[e];
          v.v[e] = p.beta2 * v.v[e] + (1.f - p.beta2) * g.v[e] * g.v[e];
          const float upd = (m.v[e] / bc1) / (sqrtf(v.v[e] / bc2) + p.eps);
          w.v[e] -= p.lr * (upd + p.weight_decay * w.v[e]);
        }
        w.store(row + c);
        m.store(row + dim + c);
        v.store(row + 2 * dim + c);
      }
      __syncwarp();
      if (lane == 0) row[3 * dim] = t;
    } else if (OPT == 2) {  // Adagrad
      for (int c = lane * VEC; c < dim; c += 32 * VEC) {
        Vec<VEC> g = reduce_grad<VEC>(grad, dim, perm, lo, hi, c);
        Vec<VEC> w, a;
        w.load(row + c);
        a.load(row + dim + c);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float ge = g.v[e] + p.weight_decay * w.v[e];
          a.v[e] += ge * ge;
          w.v[e] -= p.lr * ge / (sqrtf(a.v[e]) + p.eps);
        }
        w.store(row + c);
        a.store(row + dim + c);
      }
    } else {  // row-wise Adagrad: one accumulator per row (mean of g^2), column dim
      float sumsq = 0.f;
      for (int c = lane * VEC; c < dim; c += 32 * VEC) {
        Vec<VEC> g = reduce_grad<VEC>(grad, dim, perm, lo, hi, c);
        Vec<VEC> w;
        w.load(row + c);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float ge = g.v[e] + p.weight_decay * w.v[e];
          sumsq += ge * ge;
        }
      }
      for (int o = 16; o > 0; o >>= 1) sumsq += __shfl_xor_sync(kFull, sumsq, o);
      const float acc = row[dim] + sumsq / static_cast<float>(dim);
      const float scale = p.lr / (sqrtf(acc) + p.eps);
      for (int c = lane * VEC; c < dim; c += 32 * VEC) {
        Vec<VEC> g = reduce_grad<VEC>(grad, dim, perm, lo, hi, c);
        Vec<VEC> w;
        w.load(row + c);
#pragma unroll
        for (int e = 0; e < VEC; ++e) w.v[e] -= scale * (g.v[e] + p.weight_decay * w.v[e]);
        w.store(row + c);
      }
      __syncwarp();
      if (lane == 0) row[dim] = acc;
    }
  }
}

template <int OPT>
void launch_update_opt(float* values, int64_t width, int dim, const int64_t* keys,
                       const int64_t* uniq, const int64_t* slots, const int64_t* perm,
                       const int64_t* offsets, const float* grad, int64_t num_unique,
                       const OptParams& opt, cudaStream_t stream) {
  const int grid = grid_for(num_unique, kThreads / 32);
  if (dim % 4 == 0) {
    update_kernel<OPT, 4><<<grid, kThreads, 0, stream>>>(values, width, dim, keys, uniq, slots,
                                                         perm, offsets, grad, num_unique, opt);
  } else {
    update_kernel<OPT, 1><<<grid, kThreads, 0, stream>>>(values, width, dim, keys, uniq, slots,
                                                         perm, offsets, grad, num_unique, opt);
  }
}

}  // namespace

void launch_gather(const float* values, int64_t width, int dim, const int64_t* slots,
                   const int64_t* inverse, int64_t n, float* out, cudaStream_t stream) {
  if (n == 0) return;
  if (dim % 4 == 0) {
    gather_kernel<4><<<grid_for(n * (dim / 4), kThreads), kThreads, 0, stream>>>(
        values, width, dim, slots, inverse, n, out);
  } else {
    gather_kernel<1><<<grid_for(n * dim, kThreads), kThreads, 0, stream>>>(values, width, dim,
                                                                           slots, inverse, n, out);
  }
}

void launch_update(float* values, int64_t width, int dim, const int64_t* keys, const int64_t* uniq,
                   const int64_t* slots, const int64_t* perm, const int64_t* offsets,
                   const float* grad, int64_t num_unique, const OptParams& opt,
                   cudaStream_t stream) {
  if (num_unique == 0) return;
  switch (opt.code) {
    case 0:
      launch_update_opt<0>(values, width, dim, keys, uniq, slots, perm, offsets, grad, num_unique,
                           opt, stream);
      break;
    case 1:
      launch_update_opt<1>(values, width, dim, keys, uniq, slots, perm, offsets, grad, num_unique,
                           opt, stream);
      break;
    case 2:
      launch_update_opt<2>(values, width, dim, keys, uniq, slots, perm, offsets, grad, num_unique,
                           opt, stream);
      break;
    default:
      launch_update_opt<3>(values, width, dim, keys, uniq, slots, perm, offsets, grad, num_unique,
                           opt, stream);
  }
}

}  // namespace dynemb
