// out = x + y w^T as one cuBLASLt matmul whose C (x) and D (out) are different matrices.
//
// The fused HSTU layer adds its output projection onto the fp32 residual stream x. torch.addmm
// (x, y, w^T) computes that with C = D: it first copies x into the result, a full read and
// write of the [T, D] fp32 stream per layer (a device-to-device copy of ~100 MB per layer at the
// benchmark model's shapes), and then lets the GEMM read it back. cuBLASLt takes C and D as two
// matrices, so the GEMM reads x once and writes out once, with the same epilogue (beta = 1).
//
// Layouts (row-major torch tensors as cuBLAS's column-major matrices):
//   w   [N, K] row-major = K x N column-major (ld = w's row stride), used transposed: N x K
//   y   [T, K] row-major = K x T column-major (ld = y's row stride)
//   x   [T, N] row-major = N x T column-major (ld = x's row stride), fp32
//   out [T, N] row-major, contiguous, fp32
// D (N x T) = op(A) op(B) + C = w y^T + x^T, i.e. out = y w^T + x.
//
// The matmul's algorithm is chosen once per shape, leading dimensions, dtype, pointer alignment
// and device (cached with its descriptors): cuBLASLt's heuristic proposes up to kCandidates
// algorithms and the first call of the shape times each of them (one warm-up run, then
// kTimedRuns, on the call's own stream and tensors; the call then runs the fastest, so its result
// is the chosen algorithm's). The heuristic's first choice alone measured up to 1.4x slower than
// the fastest at some token counts (docs/kernels.md, "Fused HSTU layer"). The first choice is
// kept, untimed, inside a CUDA graph capture (a capture cannot wait on events), under
// torch.use_deterministic_algorithms (the choice would then depend on timing noise: another run
// could pick an algorithm with another summation order) and with HSTU_RESIDUAL_GEMM_TUNE=0. The
// workspace is torch's cuBLASLt workspace for the current stream, as torch's own matmuls use it.
// Declared in api.cpp, which checks the tensors first (this file, like api.cpp, is torch glue:
// the kernel headers and .cu files stay torch-free).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace lnmd {
namespace {

void check_lt(cublasStatus_t status, const char* call) {
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "layer_norm_mul_dropout: residual_gemm: ", call,
              " failed with cuBLAS status ", static_cast<int>(status));
}

// The largest power of two (<= 256) that divides the address: what the heuristic may assume.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  // the heuristic's proposals, best first, until the first call has timed them
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;

  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// (device, dtype, T, N, K, ld w, ld y, ld x, alignments of w, y, x, out, workspace bytes)
using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, uint32_t,
                           uint32_t, uint32_t, uint32_t, size_t>;

constexpr int kCandidates = 8;  // algorithms the heuristic proposes for the timing
constexpr int kTimedRuns = 3;   // timed runs of each

std::unique_ptr<Plan> make_plan(cublasLtHandle_t lt, cudaDataType_t dt, int64_t t, int64_t n,
                                int64_t k, int64_t ldw, int64_t ldy, int64_t ldx,
                                const uint32_t align[4], size_t workspace) {
  auto plan = std::make_unique<Plan>();
  check_lt(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
           "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
           "cublasLtMatmulDescSetAttribute(TRANSA)");
  check_lt(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
           "cublasLtMatmulDescSetAttribute(TRANSB)");
  check_lt(cublasLtMatrixLayoutCreate(&plan->a, dt, k, n, ldw), "cublasLtMatrixLayoutCreate(w)");
  check_lt(cublasLtMatrixLayoutCreate(&plan->b, dt, k, t, ldy), "cublasLtMatrixLayoutCreate(y)");
  check_lt(cublasLtMatrixLayoutCreate(&plan->c, CUDA_R_32F, n, t, ldx),
           "cublasLtMatrixLayoutCreate(x)");
  check_lt(cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_32F, n, t, n),
           "cublasLtMatrixLayoutCreate(out)");

  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t ws = workspace;
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; ++i) {
    st = cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i], sizeof(align[i]));
  }
  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(lt, plan->op, plan->a, plan->b, plan->c, plan->d, pref,
                                        kCandidates, results, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  check_lt(st, "cublasLtMatmulAlgoGetHeuristic");
  TORCH_CHECK(found > 0, "layer_norm_mul_dropout: residual_gemm: cuBLASLt has no algorithm for "
              "T=", t, " N=", n, " K=", k, " (set NetworkArgs.fused_residual_gemm=False)");
  plan->algo = results[0].algo;
  plan->workspace = results[0].workspaceSize;
  for (int i = 0; i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) plan->candidates.push_back(results[i]);
  }
  return plan;
}

enum class Tuning { kOff, kLater, kNow };

// Whether a call on ``stream`` times the proposals: not under deterministic algorithms or with
// HSTU_RESIDUAL_GEMM_TUNE=0 (off for good), not inside a capture (a later eager call does).
Tuning tuning(cudaStream_t stream) {
  const char* e = std::getenv("HSTU_RESIDUAL_GEMM_TUNE");
  if ((e != nullptr && std::strcmp(e, "0") == 0) || at::globalContext().deterministicAlgorithms()) {
    return Tuning::kOff;
  }
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  return capturing == cudaStreamCaptureStatusNone ? Tuning::kNow : Tuning::kLater;
}

struct Operands {
  const void *w, *y, *x;
  void* out;
  void* ws;
};

cublasStatus_t run(cublasLtHandle_t lt, const Plan& plan, const cublasLtMatmulAlgo_t& algo,
                   size_t workspace, const Operands& o, cudaStream_t stream) {
  const float alpha = 1.0f, beta = 1.0f;
  return cublasLtMatmul(lt, plan.op, &alpha, o.w, plan.a, o.y, plan.b, &beta, o.x, plan.c, o.out,
                        plan.d, &algo, o.ws, workspace, stream);
}

// Times the plan's candidates on the call's operands (out is written, then overwritten by the
// call itself) and keeps the fastest; a candidate that fails to launch is skipped.
void choose_algorithm(cublasLtHandle_t lt, Plan& plan, const Operands& o, cudaStream_t stream) {
  cudaEvent_t start = nullptr, stop = nullptr;
  C10_CUDA_CHECK(cudaEventCreate(&start));
  C10_CUDA_CHECK(cudaEventCreate(&stop));
  float best = std::numeric_limits<float>::infinity();
  for (const auto& cand : plan.candidates) {
    if (run(lt, plan, cand.algo, cand.workspaceSize, o, stream) != CUBLAS_STATUS_SUCCESS) continue;
    C10_CUDA_CHECK(cudaEventRecord(start, stream));
    bool ok = true;
    for (int r = 0; r < kTimedRuns && ok; ++r) {
      ok = run(lt, plan, cand.algo, cand.workspaceSize, o, stream) == CUBLAS_STATUS_SUCCESS;
    }
    C10_CUDA_CHECK(cudaEventRecord(stop, stream));
    C10_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (ok && ms < best) {
      best = ms;
      plan.algo = cand.algo;
      plan.workspace = cand.workspaceSize;
    }
  }
  C10_CUDA_CHECK(cudaEventDestroy(start));
  C10_CUDA_CHECK(cudaEventDestroy(stop));
}

}  // namespace

void residual_gemm_lt(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,
                      at::Tensor& out) {
  const int64_t t = y.size(0), k = y.size(1), n = w.size(0);
  const cudaDataType_t dt = y.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  cublasLtHandle_t lt = at::cuda::getCurrentCUDABlasLtHandle();
  const size_t ws_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* ws = at::cuda::getCUDABlasLtWorkspace();
  const uint32_t align[4] = {alignment_of(w.data_ptr()), alignment_of(y.data_ptr()),
                             alignment_of(x.data_ptr()), alignment_of(out.data_ptr())};
  const PlanKey key{x.get_device(), static_cast<int>(dt), t, n, k, w.stride(0), y.stride(0),
                    x.stride(0), align[0], align[1], align[2], align[3], ws_size};

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const Operands ops{w.data_ptr(), y.data_ptr(), x.data_ptr(), out.data_ptr(), ws};

  static std::mutex mu;
  static std::map<PlanKey, std::unique_ptr<Plan>> plans;
  Plan* plan = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it == plans.end()) {
      it = plans.emplace(key, make_plan(lt, dt, t, n, k, w.stride(0), y.stride(0), x.stride(0),
                                        align, ws_size))
               .first;
    }
    plan = it->second.get();
    // the first call outside a capture times the proposals; a capture runs the first choice
    if (!plan->candidates.empty()) {
      const Tuning when = tuning(stream);
      if (when == Tuning::kNow && plan->candidates.size() > 1) {
        choose_algorithm(lt, *plan, ops, stream);
      }
      if (when != Tuning::kLater) plan->candidates.clear();
    }
  }
  check_lt(run(lt, *plan, plan->algo, plan->workspace, ops, stream), "cublasLtMatmul");
}

}  // namespace lnmd
