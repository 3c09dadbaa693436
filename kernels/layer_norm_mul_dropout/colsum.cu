// The last step of every weight- and bias-gradient sum of this extension: the kernels leave one
// fp32 partial row per block ([rows, width] with width = nouts x cols: nouts sums of cols
// columns side by side, e.g. dweight and dbias), and this kernel adds the rows up. One launch
// for all nouts sums, each written to its own tensor. The order of the additions is fixed (each
// thread adds its row group in row order, then the row groups are added in order), so the
// result does not depend on scheduling: bitwise reproducible. Torch-free; api.cpp calls it.
#include <cuda_runtime.h>

#include "launch.h"

static_assert(lnmd::kMaxSumOuts == 2, "sum_partials_kernel picks its output out of two");

namespace lnmd {
namespace {

constexpr int kSumColThreads = 8;   // threads along the columns, 4 columns (one float4) each
constexpr int kSumRowGroups = 32;   // threads along the rows
constexpr int kSumCols = 4 * kSumColThreads;  // columns per block

__global__ void __launch_bounds__(kSumColThreads* kSumRowGroups)
    sum_partials_kernel(SumPartialsParams p) {
  __shared__ float4 red[kSumRowGroups][kSumColThreads];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int c = (blockIdx.x * kSumColThreads + tx) * 4;  // first of this thread's 4 columns
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (c < p.width) {
    const float* src = p.partials + c;
#pragma unroll 4
    for (int r = ty; r < p.rows; r += kSumRowGroups) {
      const float4 v = *reinterpret_cast<const float4*>(src + int64_t(r) * p.width);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
  }
  red[ty][tx] = acc;
  __syncthreads();
  if (ty != 0 || c >= p.width) return;
  float4 s = red[0][tx];
#pragma unroll
  for (int g = 1; g < kSumRowGroups; ++g) {
    const float4 v = red[g][tx];
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
  }
  // cols % 4 == 0: the 4 columns belong to one output
  const int o = c / p.cols, j = c - o * p.cols;
  float* out = o == 0 ? p.outs[0] : p.outs[1];  // kMaxSumOuts == 2 (no local copy of outs)
  *reinterpret_cast<float4*>(out + j) = s;
}

}  // namespace

void launch_sum_partials(const SumPartialsParams& p, cudaStream_t stream) {
  if (p.width == 0) return;
  const dim3 block(kSumColThreads, kSumRowGroups);
  const dim3 grid((p.width + kSumCols - 1) / kSumCols);
  sum_partials_kernel<<<grid, block, 0, stream>>>(p);
}

}  // namespace lnmd
