// Launches of the chunk-major SiLU kernels (silu_kernel.h) for bf16 and fp16: block shape from
// the row width, grid from the occupancy (column_layout.h). Torch-free; api.cpp calls these.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launch.h"
#include "silu_kernel.h"

namespace lnmd {
namespace {

template <typename T, bool kDqF32>
int silu_bwd_per_sm() {
  static const int per_sm = column_blocks_per_sm(silu_bwd_kernel<T, kDqF32>);
  return per_sm;
}

template <typename T>
int silu_bwd_per_sm(bool dq_f32) {
  return dq_f32 ? silu_bwd_per_sm<T, true>() : silu_bwd_per_sm<T, false>();
}

template <typename T>
void run_silu_fwd(const SiluFwdParams& p, int num_sms, cudaStream_t stream) {
  if (p.rows == 0) return;
  static const int per_sm = column_blocks_per_sm(silu_fwd_kernel<T>);
  const int nchunks = (4 - p.first_block) * (p.hd / 8);
  const dim3 grid(column_grid_x(nchunks), column_grid_y(nchunks, p.rows, per_sm, num_sms));
  silu_fwd_kernel<T><<<grid, column_block(nchunks), 0, stream>>>(p);
}

template <typename T>
void run_silu_bwd(const SiluBwdParams& p, int grid_y, cudaStream_t stream) {
  if (p.rows == 0 || grid_y == 0) return;
  const int nchunks = p.hd / 2;
  const dim3 grid(column_grid_x(nchunks), grid_y);
  if (p.grad2_f32 != nullptr) {
    silu_bwd_kernel<T, true><<<grid, column_block(nchunks), 0, stream>>>(p);
  } else {
    silu_bwd_kernel<T, false><<<grid, column_block(nchunks), 0, stream>>>(p);
  }
}

}  // namespace

int silu_bwd_grid(DType dtype, int hd, int64_t rows, int num_sms, bool dq_f32) {
  if (rows == 0) return 0;
  const int per_sm = dtype == DType::kBF16 ? silu_bwd_per_sm<__nv_bfloat16>(dq_f32)
                                           : silu_bwd_per_sm<__half>(dq_f32);
  return column_grid_y(hd / 2, rows, per_sm, num_sms);
}

void launch_silu_fwd(DType dtype, const SiluFwdParams& p, int num_sms, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    run_silu_fwd<__nv_bfloat16>(p, num_sms, stream);
  } else {
    run_silu_fwd<__half>(p, num_sms, stream);
  }
}

void launch_silu_bwd(DType dtype, const SiluBwdParams& p, int grid_y, cudaStream_t stream) {
  if (dtype == DType::kBF16) {
    run_silu_bwd<__nv_bfloat16>(p, grid_y, stream);
  } else {
    run_silu_bwd<__half>(p, grid_y, stream);
  }
}

}  // namespace lnmd
