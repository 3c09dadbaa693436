// Throughput of fp32 reductions into L2-resident rows, in the access patterns the d256 backward's
// dQ reductions could take (built and run by `bash scripts/gpu_check.sh red-throughput`; an
// SM90 GPU; compiled on CPU by tests/test_attention_compile.py):
//   fragment   red.global.add.v2.f32 straight from a wgmma accumulator fragment: a warp
//              instruction covers 8 rows x 32 bytes (what bwd_kernel_sm90.h does);
//   whole-line red.global.add.v4.f32, a warp instruction covering 4 rows x 128 bytes (what a
//              dQ staged through shared memory could issue);
//   bulk       cp.reduce.async.bulk (TMA) of 1 KB rows from shared memory, `stage` rows per
//              group, waiting for the group's shared-memory reads before the next;
//   store      st.global.v4 whole lines (no reduction), for scale.
// Each CTA (256 threads, one per SM as the backward's) adds 128 x 256 fp32 tiles (128 KB, a
// query block's dQ) into a row block that CTAs 2k and 2k + 1 share, walking the blocks in step
// as the backward's key blocks n and n + 1 walk their query blocks. Prints ms and GB/s per
// pattern (the best of 5 runs).
#include <cstdio>

#include <cuda_runtime.h>

namespace {

constexpr int kRows = 128;
constexpr int kCols = 256;
constexpr int kThreads = 256;

__device__ __forceinline__ float* tile_ptr(float* buf, int blocks, int it) {
  const int group = blockIdx.x / 64;
  const int pair = (blockIdx.x % 64) / 2;
  return buf + (size_t(group) * blocks + (pair + it) % blocks) * kRows * kCols;
}

__device__ __forceinline__ void red_v2(float* p, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}

__device__ __forceinline__ void red_v4(float* p, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}

// Warpgroup w owns rows 64w..; warp i of it rows 16i..16i+15; lane l holds (row l/4 + 8r,
// columns 8g + 2(l%4) + {0, 1}) of each 128-column chunk, as a wgmma accumulator does.
__global__ void __launch_bounds__(kThreads, 1) fragment(float* buf, int blocks, int iters) {
  const int t = threadIdx.x, wg = t / 128, w = (t % 128) / 32, l = t % 32;
  for (int it = 0; it < iters; ++it) {
    float* base = tile_ptr(buf, blocks, it);
    for (int chunk = 0; chunk < 2; ++chunk) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int g = 0; g < 16; ++g) {
          const int row = 64 * wg + 16 * w + l / 4 + 8 * r;
          const int col = chunk * 128 + 8 * g + 2 * (l % 4);
          red_v2(base + row * kCols + col, 1.f, 1.f);
        }
      }
    }
  }
}

// Whole 128-byte lines, 16 bytes a thread: reduced (kReduce) or stored.
template <bool kReduce>
__global__ void __launch_bounds__(kThreads, 1) whole_line(float* buf, int blocks, int iters) {
  const int t = threadIdx.x;
  const float4 one = make_float4(1.f, 1.f, 1.f, 1.f);
  for (int it = 0; it < iters; ++it) {
    float* base = tile_ptr(buf, blocks, it);
#pragma unroll 4
    for (int i = 0; i < kRows * kCols / 4 / kThreads; ++i) {
      float* p = base + (i * kThreads + t) * 4;
      if constexpr (kReduce) {
        red_v4(p, one);
      } else {
        *reinterpret_cast<float4*>(p) = one;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) bulk(float* buf, int blocks, int iters, int stage) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) float sm[];
  const int t = threadIdx.x;
  for (int i = t; i < stage * kCols; i += kThreads) sm[i] = 1.f;
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  for (int it = 0; it < iters; ++it) {
    float* base = tile_ptr(buf, blocks, it);
    for (int r0 = 0; r0 < kRows; r0 += stage) {
      if (t < stage) {
        const unsigned src = unsigned(__cvta_generic_to_shared(sm + t * kCols));
        asm volatile(
            "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                base + (r0 + t) * kCols),
            "r"(src), "r"(kCols * 4)
            : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
      }
      __syncthreads();
    }
  }
  if (t < stage) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

}  // namespace

int main() {
  int sms = 0, major = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major < 9) {
    std::printf("needs compute capability 9.0 or newer (found %d.x)\n", major);
    return 1;
  }
  const int groups = 2, blocks = 24, iters = 40, grid = 64 * groups;
  const size_t n = size_t(groups) * blocks * kRows * kCols;
  float* buf = nullptr;
  if (cudaMalloc(&buf, n * sizeof(float)) != cudaSuccess) return 1;
  cudaMemset(buf, 0, n * sizeof(float));
  std::printf("%d SMs, %d CTAs, %.1f MB of rows, %d tiles of 128 KB per CTA\n", sms, grid,
              n * 4 / 1e6, iters);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const double bytes = double(grid) * iters * kRows * kCols * 4;
  int failures = 0;
  auto report = [&](const char* name, auto launch) {
    launch();
    cudaDeviceSynchronize();
    float best = 1e30f;
    for (int rep = 0; rep < 5; ++rep) {
      cudaEventRecord(a);
      launch();
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float ms = 0.f;
      cudaEventElapsedTime(&ms, a, b);
      best = ms < best ? ms : best;
    }
    const cudaError_t e = cudaGetLastError();
    failures += e != cudaSuccess;
    std::printf("%-24s %8.3f ms %7.0f GB/s %s\n", name, best, bytes / best / 1e6,
                e == cudaSuccess ? "" : cudaGetErrorString(e));
  };
  report("fragment red.v2", [&] { fragment<<<grid, kThreads>>>(buf, blocks, iters); });
  report("whole-line red.v4", [&] { whole_line<true><<<grid, kThreads>>>(buf, blocks, iters); });
  report("store st.v4", [&] { whole_line<false><<<grid, kThreads>>>(buf, blocks, iters); });
  for (int stage : {16, 64, 128}) {
    const int smem = stage * kCols * 4;
    cudaFuncSetAttribute(bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    char name[48];
    std::snprintf(name, sizeof(name), "bulk, %d rows a group", stage);
    report(name, [&] { bulk<<<grid, kThreads, smem>>>(buf, blocks, iters, stage); });
  }
  cudaFree(buf);
  return failures ? 1 : 0;
}
