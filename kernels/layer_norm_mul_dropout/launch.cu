// dtype switch over the per-dtype instantiations (instantiations/bf16.cu, instantiations/fp16.cu).
#include "launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lnmd {

int bwd_grid(DType dtype, int cols, int64_t rows, int num_sms) {
  return dtype == DType::kBF16 ? grid_bwd<__nv_bfloat16>(cols, rows, num_sms)
                               : grid_bwd<__half>(cols, rows, num_sms);
}

void launch_fwd(DType dtype, const FwdParams& p, int num_sms, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    run_fwd<__nv_bfloat16>(p, num_sms, stream);
  } else {
    run_fwd<__half>(p, num_sms, stream);
  }
}

void launch_bwd(DType dtype, const BwdParams& p, int grid, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    run_bwd<__nv_bfloat16>(p, grid, stream);
  } else {
    run_bwd<__half>(p, grid, stream);
  }
}

int ln_bwd_grid(DType dtype, int cols, int64_t rows, int num_sms) {
  return dtype == DType::kBF16 ? grid_ln_bwd<__nv_bfloat16>(cols, rows, num_sms)
                               : grid_ln_bwd<__half>(cols, rows, num_sms);
}

void launch_ln_fwd(DType dtype, const LnFwdParams& p, int num_sms, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    run_ln_fwd<__nv_bfloat16>(p, num_sms, stream);
  } else {
    run_ln_fwd<__half>(p, num_sms, stream);
  }
}

void launch_ln_bwd(DType dtype, const LnBwdParams& p, int grid, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    run_ln_bwd<__nv_bfloat16>(p, grid, stream);
  } else {
    run_ln_bwd<__half>(p, grid, stream);
  }
}

}  // namespace lnmd
