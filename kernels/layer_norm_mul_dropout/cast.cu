// Launch of the cast + column-sum kernel (cast_kernel.h) for bf16 and fp16 outputs. Torch-free;
// api.cpp calls these.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cast_kernel.h"
#include "launch.h"

namespace lnmd {
namespace {

template <typename T>
int cast_per_sm() {
  static const int per_sm = column_blocks_per_sm(cast_colsum_kernel<T>);
  return per_sm;
}

}  // namespace

int cast_colsum_grid(DType dtype, int cols, int64_t rows, int num_sms) {
  if (rows == 0) return 0;
  const int per_sm = dtype == DType::kBF16 ? cast_per_sm<__nv_bfloat16>() : cast_per_sm<__half>();
  return column_grid_y(cols / 8, rows, per_sm, num_sms);
}

void launch_cast_colsum(DType dtype, const CastColsumParams& p, int grid_y, cudaStream_t stream) {
  if (p.rows == 0 || grid_y == 0) return;
  const int nchunks = p.cols / 8;
  const dim3 grid(column_grid_x(nchunks), grid_y);
  if (dtype == DType::kBF16) {
    cast_colsum_kernel<__nv_bfloat16><<<grid, column_block(nchunks), 0, stream>>>(p);
  } else {
    cast_colsum_kernel<__half><<<grid, column_block(nchunks), 0, stream>>>(p);
  }
}

}  // namespace lnmd
