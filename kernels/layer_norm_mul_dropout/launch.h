// Host-side dispatch: picks the row-group layout (warps per row, chunks per thread) for the row
// width, the grid from the occupancy, and launches. Torch-free; api.cpp calls these.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"

namespace lnmd {

// Launch shape of one (dtype, cols): warps per row and 8-element chunks per thread.
struct Shape {
  int wpr;
  int iters;
};

inline Shape shape_for(int cols) {
  const int chunks = cols / 8;
  if (chunks <= 32) return {1, 1};
  if (chunks <= 64) return {1, 2};
  if (chunks <= 128) return {2, 2};
  if (chunks <= 256) return {4, 2};
  if (chunks <= 512) return {4, 4};
  return {4, 8};
}

// Blocks the backward launches for this problem (api.cpp sizes the partial buffer with it).
int bwd_grid(DType dtype, int cols, int64_t rows, int num_sms);

void launch_fwd(DType dtype, const FwdParams& p, int num_sms, cudaStream_t stream);
void launch_bwd(DType dtype, const BwdParams& p, int grid, cudaStream_t stream);

// The input LayerNorm of the fp32 residual stream (ln_kernel.h); dtype: the 16-bit n / dn.
int ln_bwd_grid(DType dtype, int cols, int64_t rows, int num_sms);
void launch_ln_fwd(DType dtype, const LnFwdParams& p, int num_sms, cudaStream_t stream);
void launch_ln_bwd(DType dtype, const LnBwdParams& p, int grid, cudaStream_t stream);

// Chunk-major SiLU of the uvqk projection and its backward (silu.cu). silu_bwd_grid: the
// number of block rows the backward launches (api.cpp sizes the bias partials [grid, 4 * hd]).
int silu_bwd_grid(DType dtype, int hd, int64_t rows, int num_sms, bool dq_f32 = false);
void launch_silu_fwd(DType dtype, const SiluFwdParams& p, int num_sms, cudaStream_t stream);
void launch_silu_bwd(DType dtype, const SiluBwdParams& p, int grid_y, cudaStream_t stream);

// Cast of an fp32 [rows, cols] tensor to 16 bits plus its fp32 column sums (cast.cu);
// cast_colsum_grid: the block rows launched (api.cpp sizes the partials [grid, cols]).
int cast_colsum_grid(DType dtype, int cols, int64_t rows, int num_sms);
void launch_cast_colsum(DType dtype, const CastColsumParams& p, int grid_y, cudaStream_t stream);

// Sums the fp32 partial rows of the kernels above into their outputs (colsum.cu): one launch
// for all of a call's sums, in a fixed order (bitwise reproducible).
void launch_sum_partials(const SumPartialsParams& p, cudaStream_t stream);

// The sequence preprocessor's token assembly (tokens.cu). tokens_bwd_shape: the block shape
// (x: threads per row, y: lane groups) and grid of the backward for this problem (api sizes the
// partial buffer [grid * y, num_bits + 1, cols] with it) and its dynamic shared memory in bytes.
struct TokensBwdShape {
  int tx;
  int ty;
  int grid;
  int smem;
};
TokensBwdShape tokens_bwd_shape(int cols, int num_bits, int64_t work, int num_sms);
// The largest num_bits the backward's shared-memory sums fit at this width (-1: none).
int tokens_max_bits(int cols);
void launch_tokens_fwd(const TokensFwdParams& p, int num_sms, cudaStream_t stream);
void launch_tokens_bwd(const TokensBwdParams& p, const TokensBwdShape& s, cudaStream_t stream);

// Per-dtype entry points (instantiations/*.cu).
template <typename T>
void run_fwd(const FwdParams& p, int num_sms, cudaStream_t stream);
template <typename T>
int grid_bwd(int cols, int64_t rows, int num_sms);
template <typename T>
void run_bwd(const BwdParams& p, int grid, cudaStream_t stream);
template <typename T>
void run_ln_fwd(const LnFwdParams& p, int num_sms, cudaStream_t stream);
template <typename T>
int grid_ln_bwd(int cols, int64_t rows, int num_sms);
template <typename T>
void run_ln_bwd(const LnBwdParams& p, int grid, cudaStream_t stream);

}  // namespace lnmd
