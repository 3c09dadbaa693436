// out = x + y w^T from one cuBLASLt matmul (residual_gemm.cpp); the torch op residual_gemm in
// api.cpp checks the tensors first.
#pragma once

#include <ATen/core/Tensor.h>

namespace lnmd {

// x fp32 [T, N] (row stride >= N, last dim contiguous), y bf16/fp16 [T, K] (last dim
// contiguous), w y's dtype [N, K] (last dim contiguous), out fp32 [T, N] contiguous, all on the
// current CUDA device; T, N, K > 0.
void residual_gemm_lt(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,
                      at::Tensor& out);

}  // namespace lnmd
