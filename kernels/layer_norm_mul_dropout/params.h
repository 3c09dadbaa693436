// Arguments of the LayerNorm(x) * u * dropout kernels (torch-free; filled in by api.cpp).
//
// x, u, dy: [rows, cols] 16-bit (bf16 or fp16), last dim contiguous, any row stride that is a
// multiple of 8 elements with 16-byte aligned base pointers (u may be a column slice of the uvqk
// activations). weight, bias: fp32 [cols]. Outputs are [rows, cols] in the input dtype, contiguous
// but for the forward's y (its own row stride, a multiple of 8: it may fill part of a wider tensor);
// mean and rstd are fp32 [rows]. cols is a multiple of 8 in [8, kMaxCols].
#pragma once

#include <cmath>
#include <cstdint>

namespace lnmd {

constexpr int kMaxCols = 8192;
constexpr int kThreads = 128;  // 4 warps per block

enum class DType { kBF16, kFP16 };

struct Dropout {
  uint64_t seed = 0;
  uint64_t offset = 0;
  uint32_t threshold = 0;  // keep iff 16-bit draw >= threshold; 0 = no dropout
  float scale = 1.0f;      // 65536 / (65536 - threshold)
  // When set: int64 [2] in device memory holding (seed, offset), read by the kernel in place of
  // the two fields above. A CUDA graph replays the launch with fresh values in that memory (the
  // caller draws them inside the graph), where by-value fields would repeat the captured mask.
  const int64_t* seed_offset = nullptr;
};

// The Dropout of probability p (0 <= p < 1, checked by the caller): p quantised to
// threshold / 65536 (philox.h), kept elements scaled by 65536 / (65536 - threshold).
inline Dropout make_dropout_params(double p, uint64_t seed, uint64_t offset) {
  Dropout d;
  d.seed = seed;
  d.offset = offset;
  int64_t thr = static_cast<int64_t>(std::llround(p * 65536.0));
  if (thr > 65535) thr = 65535;
  d.threshold = static_cast<uint32_t>(thr);
  d.scale = thr == 0 ? 1.0f : static_cast<float>(65536.0 / static_cast<double>(65536 - thr));
  return d;
}

struct FwdParams {
  const void* x = nullptr;
  int64_t x_stride = 0;
  const void* u = nullptr;
  int64_t u_stride = 0;
  const float* weight = nullptr;
  const float* bias = nullptr;
  void* y = nullptr;       // [rows, cols], row stride y_stride (a multiple of 8)
  int64_t y_stride = 0;
  float* mean = nullptr;   // [rows]
  float* rstd = nullptr;   // [rows]
  int64_t rows = 0;
  int cols = 0;
  float eps = 1e-6f;
  Dropout dropout;
  bool u_silu = false;     // u holds the pre-activation: the kernel uses SiLU(u) rounded to T
};

struct BwdParams {
  const void* dy = nullptr;
  int64_t dy_stride = 0;
  const void* x = nullptr;
  int64_t x_stride = 0;
  const void* u = nullptr;
  int64_t u_stride = 0;
  const float* weight = nullptr;
  const float* bias = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  void* dx = nullptr;          // [rows, cols]
  void* du = nullptr;          // [rows, cols], row stride du_stride
  int64_t du_stride = 0;
  void* y = nullptr;           // [rows, cols] recomputed forward output, or nullptr
  float* partials = nullptr;   // [grid, 2, cols]: per-block d weight (row 0) and d bias (row 1)
  int64_t rows = 0;
  int cols = 0;
  Dropout dropout;
  // u holds the pre-activation z_u: the kernel uses SiLU(z_u) rounded to T as u and writes
  // du * SiLU'(z_u) (du rounded to T first: the unfused SiLU backward's input) in place of du
  bool u_silu = false;
};

// The input LayerNorm on the fp32 residual stream (ln_kernel.h). x, dres: fp32 [rows, cols],
// last dim contiguous, row stride a multiple of 8 elements, 16-byte aligned; dn: 16-bit, same
// rules. n (16-bit) and dx (fp32) are contiguous [rows, cols].
struct LnFwdParams {
  const float* x = nullptr;
  int64_t x_stride = 0;
  const float* weight = nullptr;
  const float* bias = nullptr;
  void* n = nullptr;       // [rows, cols]
  float* mean = nullptr;   // [rows]
  float* rstd = nullptr;   // [rows]
  int64_t rows = 0;
  int cols = 0;
  float eps = 1e-6f;
};

struct LnBwdParams {
  const void* dn = nullptr;
  int64_t dn_stride = 0;
  const float* x = nullptr;
  int64_t x_stride = 0;
  const float* dres = nullptr;  // gradient reaching x through the residual connection
  int64_t dres_stride = 0;
  const float* weight = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  float* dx = nullptr;          // [rows, cols]
  float* partials = nullptr;    // [grid, 2, cols]: per-block d weight (row 0) and d bias (row 1)
  int64_t rows = 0;
  int cols = 0;
};

// SiLU of the uvqk projection, chunk-major (silu_kernel.h). z: [rows, 4 * hd] 16-bit, last dim
// contiguous, row stride a multiple of 8 elements, 16-byte aligned; hd a multiple of 8.
struct SiluFwdParams {
  const void* z = nullptr;
  int64_t z_stride = 0;
  void* act = nullptr;  // [4 - first_block, rows, hd] contiguous: (u, v, q, k) from first_block
  int64_t rows = 0;
  int hd = 0;
  int first_block = 0;  // 1: v, q, k only
};

// dz[:, b*hd:(b+1)*hd] = grad[b] * SiLU'(z[:, b*hd:(b+1)*hd]) for b = 0..3 (du, dv, dq, dk), and
// optionally the column sums of the rounded dz (the uvqk bias gradient) as per-block partials.
struct SiluBwdParams {
  const void* grad0 = nullptr;  // du [rows, hd]
  const void* grad1 = nullptr;  // dv
  const void* grad2 = nullptr;  // dq
  const void* grad3 = nullptr;  // dk
  // dq as the attention backward's fp32 accumulator, head-major [hd / head_dim, rows, head_dim]
  // (read in place of grad2 when set; silu_bwd_kernel<T, true>)
  const float* grad2_f32 = nullptr;
  int head_dim = 0;
  // block 0 of dz holds dz_u already (written by the gating backward with u_silu): its columns
  // read it for the bias sums and write nothing; grad0 unused
  bool u_prefilled = false;
  int64_t grad_stride0 = 0;
  int64_t grad_stride1 = 0;
  int64_t grad_stride2 = 0;
  int64_t grad_stride3 = 0;
  const void* z = nullptr;
  int64_t z_stride = 0;
  void* dz = nullptr;          // [rows, 4 * hd], row stride dz_stride
  int64_t dz_stride = 0;
  float* partials = nullptr;   // [gridDim.y, 4 * hd] column sums of dz per block row, or nullptr
  int64_t rows = 0;
  int hd = 0;
};

// y = x.to(T) and the fp32 column sums of x (cast_kernel.h). x: fp32 [rows, cols], last dim
// contiguous, row stride a multiple of 8 elements, 16-byte aligned; cols a multiple of 8.
struct CastColsumParams {
  const float* x = nullptr;
  int64_t x_stride = 0;
  void* y = nullptr;          // [rows, cols] contiguous, 16-bit
  float* partials = nullptr;  // [gridDim.y, cols] column sums of x per block row
  int64_t rows = 0;
  int cols = 0;
};

// Column sums of the kernels' fp32 partial rows (colsum.cu): partials [rows, width] contiguous,
// width = nouts * cols, cols a multiple of 4; out o (of nouts <= kMaxSumOuts) gets the sums of
// columns [o * cols, (o + 1) * cols), each a 16-byte aligned fp32 [cols]. rows may be 0 (zeros).
constexpr int kMaxSumOuts = 2;
struct SumPartialsParams {
  const float* partials = nullptr;
  int rows = 0;
  int width = 0;
  int cols = 0;
  float* outs[kMaxSumOuts] = {nullptr, nullptr};
};

// The sequence preprocessor's token assembly (tokens_kernel.h). All fp32 tensors contiguous
// [*, cols] (values: any row stride that is a multiple of 8) and 16-byte aligned; cols a multiple
// of 8; index tensors int64.
struct TokensFwdParams {
  const float* values = nullptr;      // [n_items, cols], row stride values_stride
  int64_t values_stride = 0;
  const float* pos_weight = nullptr;  // [positions, cols]
  const int64_t* pos_ids = nullptr;   // [n_items]
  const float* act_table = nullptr;   // [2^bits, cols]: action-bit combination sums + history
  const int64_t* actions = nullptr;   // [n_history] action words
  const int64_t* action_index = nullptr;  // [n_items]: index into actions, -1 for candidates
  int64_t action_mask = 0;
  const float* ctx = nullptr;         // [n_ctx, cols] contextual tokens
  const int64_t* row_src = nullptr;   // [rows]: item t, -1 padding, -2 - k contextual token k
  float* x = nullptr;                 // [rows, cols]
  int64_t rows = 0;
  int cols = 0;
  float item_scale = 1.0f;
  bool scale_items = false;
  Dropout dropout;
};

struct TokensBwdParams {
  const float* grad = nullptr;         // [rows, cols], row stride grad_stride
  int64_t grad_stride = 0;
  const int64_t* dest = nullptr;       // [n_items]: row of item t
  const int64_t* pos_order = nullptr;  // [n_items]: items by position (stable)
  const int64_t* pos_offsets = nullptr;  // [num_positions + 1]
  const int64_t* actions = nullptr;
  const int64_t* action_index = nullptr;
  int64_t action_mask = 0;
  int num_bits = 0;
  const int64_t* ctx_rows = nullptr;   // [n_ctx]
  int64_t num_ctx = 0;
  int64_t num_positions = 0;
  float* d_values = nullptr;           // [n_items, cols]
  float* d_pos = nullptr;              // [num_positions, cols]
  float* d_ctx = nullptr;              // [n_ctx, cols]
  float* partials = nullptr;           // [groups, num_bits + 1, cols]
  int cols = 0;
  float item_scale = 1.0f;
  bool scale_items = false;
  Dropout dropout;
};

}  // namespace lnmd
