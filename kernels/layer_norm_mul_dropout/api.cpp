// Torch face of the LayerNorm(x) * u * dropout kernels: input checks before any launch, the
// TORCH_LIBRARY schema (namespace hstu_lnmd) with CUDA and Meta implementations.
//
//   fwd(x, u, weight, bias, eps, p, seed, offset, seed_offset=None, u_silu=False, y_out=None)
//       -> (y, mean, rstd)
//     (y_out: y is written there, e.g. the first D columns of a wider tensor, and y comes back
//     empty)
//   bwd(dy, x, u, weight, bias, mean, rstd, p, seed, offset, recompute_y, seed_offset=None,
//       u_silu=False, du_out=None) -> (dx, du, dweight, dbias, y)
//     (du_out: du is written there, e.g. a column block of a wider tensor, and du comes back
//     empty)
//
// seed_offset: optional int64 [2] on x's device holding (seed, offset); the kernels then read
// those two values from device memory instead of the seed/offset arguments, so that a CUDA graph
// replay draws a fresh mask (the caller fills the tensor inside the graph).
//
// x, u, dy: [T, D] bf16/fp16 (same dtype), last dim contiguous, row stride a multiple of 8;
// weight, bias: fp32 [D]; D a multiple of 8 in [8, 8192]; 0 <= p < 1 (dropout keep mask
// regenerated from `seed` and `offset`, see philox.h). bwd's y is the recomputed forward output when
// recompute_y, else an empty tensor.
//
//   silu_chunk_major(z, first_block=0) -> act
//   silu_chunk_major_backward(du, dv, dq, dk, z, bias_grad) -> (dz, dbias)
//     (dq either [T, hd] in z's dtype or the attention backward's fp32 accumulator [H, T, D])
//   silu_chunk_major_backward_into(dv, dq, dk, z, dz!, bias_grad) -> dbias
//     (dz's u block already written by bwd(..., u_silu=True, du_out=dz[:, :hd]); dbias sums all
//     four blocks)
//
// fwd/bwd with u_silu: u is the pre-activation z_u and the kernels use SiLU(z_u) rounded to the
// input dtype (what silu_chunk_major stores); bwd then writes du * SiLU'(z_u), after rounding du,
// i.e. exactly the u block silu_chunk_major_backward would write. The fused layer uses these with
// silu_chunk_major(z, first_block=1) (act = [3, T, hd]: v, q, k).
//
// z: [T, 4*hd] bf16/fp16, hd a multiple of 8; act: [4, T, hd] = SiLU of the (u | v | q | k)
// column blocks, each a contiguous [T, hd]. du, dv, dq, dk: [T, hd] in z's dtype (any row
// stride that is a multiple of 8, separate buffers); dz: [T, 4*hd] contiguous; dbias: fp32
// [4*hd] column sums of dz when bias_grad, else an empty tensor. All 16-bit tensors: last dim
// contiguous, 16-byte aligned.
//
//   ln_fwd(x, weight, bias, eps, dtype) -> (n, mean, rstd)
//   ln_bwd(dn, x, mean, rstd, weight, dres) -> (dx, dweight, dbias)
//
// The HSTU layer's input LayerNorm on the fp32 residual stream x [T, D]: n = LayerNorm(x) in
// dtype (bf16/fp16); backward from dn (n's gradient, bf16/fp16) plus dres, the fp32 gradient
// reaching x through the residual connection: dx = dres + LayerNorm backward (fp32). x, dres:
// fp32, last dim contiguous, row stride a multiple of 8, 16-byte aligned; D as for fwd.
//
//   cast_colsum(x, dtype) -> (y, colsum)
//
// x: fp32 [T, D], D a multiple of 8 (last dim contiguous, row stride a multiple of 8, 16-byte
// aligned); y = x.to(dtype) (bf16/fp16, contiguous); colsum = x.sum(0) in fp32, same pass.
//
//   residual_gemm(x, y, w) -> out
//
// out = x + y w^T in fp32 (fp32 accumulation) from one cuBLASLt matmul that reads x as its C
// matrix and writes a new out (residual_gemm.cpp): no copy of x first, as torch.addmm makes.
// x: fp32 [T, N]; y: bf16/fp16 [T, K]; w: y's dtype [N, K]; each with a contiguous last dim and
// a row stride >= its row length; out: fp32 [T, N] contiguous.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "launch.h"

namespace lnmd {
// residual_gemm.cpp (host code calling cuBLASLt with torch's handle and workspace): out = x +
// y w^T for the checked tensors of residual_gemm below (T, N, K > 0, out fp32 [T, N] contiguous).
void residual_gemm_lt(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,
                      at::Tensor& out);
}  // namespace lnmd

namespace {

using at::Tensor;

// Messages are built with std::string (no iostream formatting in TORCH_CHECK: see the same note
// in kernels/hstu_attention/api.cpp).
[[noreturn]] void raise_value(const std::string& msg, const char* func, int line) {
  throw c10::ValueError({func, __FILE__, static_cast<uint32_t>(line)}, "layer_norm_mul_dropout: " + msg);
}
[[noreturn]] void raise_type(const std::string& msg, const char* func, int line) {
  throw c10::TypeError({func, __FILE__, static_cast<uint32_t>(line)}, "layer_norm_mul_dropout: " + msg);
}
#define LNMD_VALUE(cond, msg) \
  do {                        \
    if (!(cond)) raise_value((msg), __func__, __LINE__); \
  } while (0)
#define LNMD_TYPE(cond, msg) \
  do {                       \
    if (!(cond)) raise_type((msg), __func__, __LINE__); \
  } while (0)

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

std::string dtype_of(const Tensor& t) { return c10::toString(t.scalar_type()); }

// A [T, D] 16-bit activation the kernels read with 16-byte vectors.
void check_rows(const Tensor& t, const char* name, const Tensor& x) {
  const std::string n(name);
  LNMD_VALUE(t.is_cuda(), n + " must be a CUDA tensor; got device " + t.device().str());
  LNMD_VALUE(t.device() == x.device(), n + " is on " + t.device().str() + " but x is on " +
                                           x.device().str());
  LNMD_TYPE(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
            n + " must be bfloat16 or float16; got " + dtype_of(t));
  LNMD_TYPE(t.scalar_type() == x.scalar_type(),
            n + " has dtype " + dtype_of(t) + " but x has " + dtype_of(x));
  LNMD_VALUE(t.dim() == 2, n + " must be 2-D [T, D]; got shape " + shape_of(t));
  LNMD_VALUE(t.size(0) == x.size(0) && t.size(1) == x.size(1),
             n + " has shape " + shape_of(t) + " but x has " + shape_of(x));
  if (t.size(0) == 0) return;
  LNMD_VALUE(t.stride(1) == 1, n + " must have a contiguous last dim (stride 1); got stride " +
                                   std::to_string(t.stride(1)) + " (call .contiguous())");
  LNMD_VALUE(t.size(0) == 1 || (t.stride(0) >= t.size(1) && t.stride(0) % 8 == 0),
             n + " row stride must be >= D and a multiple of 8 elements; got " +
                 std::to_string(t.stride(0)) + " (call .contiguous())");
  LNMD_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
             n + " must start 16-byte aligned (call .contiguous())");
}

void check_vec(const Tensor& t, const char* name, int64_t n_expected, const Tensor& x) {
  const std::string n(name);
  LNMD_VALUE(t.device() == x.device(), n + " is on " + t.device().str() + " but x is on " +
                                           x.device().str());
  LNMD_TYPE(t.scalar_type() == at::kFloat, n + " must be float32; got " + dtype_of(t) +
                                               " (pass weight.float())");
  LNMD_VALUE(t.dim() == 1 && t.size(0) == n_expected && t.is_contiguous(),
             n + " must be a contiguous 1-D tensor of " + std::to_string(n_expected) +
                 " elements; got shape " + shape_of(t));
  LNMD_VALUE(n_expected == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
             n + " must start 16-byte aligned (pass a fresh tensor, e.g. .clone())");
}

void check_width(const Tensor& x) {
  const int64_t d = x.size(1);
  LNMD_VALUE(d % 8 == 0 && d >= 8 && d <= lnmd::kMaxCols,
             "the normalised dim D must be a multiple of 8 in [8, " +
                 std::to_string(lnmd::kMaxCols) + "]; got D=" + std::to_string(d) +
                 " (use FusedHSTULayer(gate_kernel='compiled') for other widths)");
}

lnmd::Dropout make_dropout(double p, int64_t seed, int64_t offset) {
  LNMD_VALUE(std::isfinite(p) && p >= 0.0 && p < 1.0,
             "dropout p must be in [0, 1); got " + std::to_string(p));
  return lnmd::make_dropout_params(p, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
}

// The device-side (seed, offset) pair, checked; nullptr when absent.
const int64_t* seed_offset_ptr(const std::optional<Tensor>& so, const Tensor& x) {
  if (!so.has_value()) return nullptr;
  const Tensor& t = *so;
  LNMD_VALUE(t.device() == x.device(), "seed_offset is on " + t.device().str() + " but x is on " +
                                           x.device().str());
  LNMD_TYPE(t.scalar_type() == at::kLong, "seed_offset must be int64; got " + dtype_of(t));
  LNMD_VALUE(t.dim() == 1 && t.size(0) == 2 && t.is_contiguous(),
             "seed_offset must be a contiguous 1-D tensor of 2 elements (seed, offset); got shape " +
                 shape_of(t));
  return t.data_ptr<int64_t>();
}

lnmd::DType dtype_enum(const Tensor& x) {
  return x.scalar_type() == at::kBFloat16 ? lnmd::DType::kBF16 : lnmd::DType::kFP16;
}

int num_sms(const Tensor& x) {
  return at::cuda::getDeviceProperties(x.device().index())->multiProcessorCount;
}

// HSTU_LNMD_PARTIAL_SUMS=torch: the partial rows summed by torch (two reductions for a
// (dweight, dbias) pair) instead of launch_sum_partials; for comparisons only.
bool torch_partial_sums() {
  static const bool on = [] {
    const char* e = std::getenv("HSTU_LNMD_PARTIAL_SUMS");
    return e != nullptr && std::strcmp(e, "torch") == 0;
  }();
  return on;
}

void check_launch() {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, std::string("layer_norm_mul_dropout: kernel launch failed: ") +
                                      cudaGetErrorString(err));
}

// The fp32 partial rows [rows, n * cols] of a kernel (n sums of cols columns side by side)
// summed into n separate [cols] tensors (op outputs must not alias one another): one
// launch_sum_partials, in a fixed order.
std::vector<Tensor> sum_partials(const Tensor& partials, int n) {
  TORCH_CHECK(n >= 1 && n <= lnmd::kMaxSumOuts && partials.dim() >= 2 && partials.size(0) > 0);
  const int64_t rows = partials.size(0);
  const int64_t cols = partials.numel() / (rows * n);
  const auto flat = partials.view({rows, n, cols});
  std::vector<Tensor> outs;
  if (torch_partial_sums()) {
    for (int o = 0; o < n; ++o) outs.push_back(flat.select(1, o).sum(0));
    return outs;
  }
  lnmd::SumPartialsParams prm;
  prm.partials = partials.data_ptr<float>();
  prm.rows = static_cast<int>(rows);
  prm.width = static_cast<int>(n * cols);
  prm.cols = static_cast<int>(cols);
  for (int o = 0; o < n; ++o) {
    outs.push_back(at::empty({cols}, partials.options()));
    prm.outs[o] = outs.back().data_ptr<float>();
  }
  lnmd::launch_sum_partials(prm, at::cuda::getCurrentCUDAStream());
  check_launch();
  return outs;
}

std::tuple<Tensor, Tensor, Tensor> fwd_cuda(const Tensor& x, const Tensor& u, const Tensor& weight,
                                            const Tensor& bias, double eps, double p,
                                            int64_t seed, int64_t offset,
                                            const std::optional<Tensor>& seed_offset,
                                            bool u_silu, const std::optional<Tensor>& y_out) {
  check_rows(x, "x", x);
  check_rows(u, "u", x);
  if (y_out.has_value()) check_rows(*y_out, "y_out", x);
  check_width(x);
  check_vec(weight, "weight", x.size(1), x);
  check_vec(bias, "bias", x.size(1), x);
  LNMD_VALUE(std::isfinite(eps) && eps > 0.0, "eps must be finite and > 0; got " +
                                                  std::to_string(eps));
  lnmd::Dropout drop = make_dropout(p, seed, offset);
  drop.seed_offset = seed_offset_ptr(seed_offset, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0);
  // y_out: y written there (e.g. the first D columns of a wider tensor); y returned empty
  auto y = y_out.has_value() ? at::empty({0}, x.options()) : at::empty({t, x.size(1)}, x.options());
  auto mean = at::empty({t}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({t}, x.options().dtype(at::kFloat));
  if (t == 0) return {y, mean, rstd};
  lnmd::FwdParams prm;
  prm.x = x.data_ptr();
  prm.x_stride = x.stride(0);
  prm.u = u.data_ptr();
  prm.u_stride = u.stride(0);
  prm.weight = weight.data_ptr<float>();
  prm.bias = bias.data_ptr<float>();
  prm.y = y_out.has_value() ? y_out->data_ptr() : y.data_ptr();
  prm.y_stride = y_out.has_value() ? y_out->stride(0) : x.size(1);
  prm.mean = mean.data_ptr<float>();
  prm.rstd = rstd.data_ptr<float>();
  prm.rows = t;
  prm.cols = static_cast<int>(x.size(1));
  prm.eps = static_cast<float>(eps);
  prm.dropout = drop;
  prm.u_silu = u_silu;
  lnmd::launch_fwd(dtype_enum(x), prm, num_sms(x), at::cuda::getCurrentCUDAStream());
  check_launch();
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_cuda(
    const Tensor& dy, const Tensor& x, const Tensor& u, const Tensor& weight, const Tensor& bias,
    const Tensor& mean, const Tensor& rstd, double p, int64_t seed, int64_t offset,
    bool recompute_y, const std::optional<Tensor>& seed_offset, bool u_silu,
    const std::optional<Tensor>& du_out) {
  check_rows(x, "x", x);
  check_rows(u, "u", x);
  check_rows(dy, "dy", x);
  if (du_out.has_value()) check_rows(*du_out, "du_out", x);
  check_width(x);
  check_vec(weight, "weight", x.size(1), x);
  check_vec(bias, "bias", x.size(1), x);
  check_vec(mean, "mean", x.size(0), x);
  check_vec(rstd, "rstd", x.size(0), x);
  lnmd::Dropout drop = make_dropout(p, seed, offset);
  drop.seed_offset = seed_offset_ptr(seed_offset, x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0);
  const int cols = static_cast<int>(x.size(1));
  auto dx = at::empty({t, cols}, x.options());
  // du_out: du written there (e.g. the u block of the fused layer's dz); du returned empty
  auto du = du_out.has_value() ? at::empty({0}, x.options()) : at::empty({t, cols}, x.options());
  auto y = recompute_y ? at::empty({t, cols}, x.options()) : at::empty({0}, x.options());
  if (t == 0) {
    return {dx, du, at::zeros({cols}, weight.options()), at::zeros({cols}, bias.options()), y};
  }
  const lnmd::DType dt = dtype_enum(x);
  const int grid = lnmd::bwd_grid(dt, cols, t, num_sms(x));
  auto partials = at::empty({grid, 2, cols}, x.options().dtype(at::kFloat));
  lnmd::BwdParams prm;
  prm.dy = dy.data_ptr();
  prm.dy_stride = dy.stride(0);
  prm.x = x.data_ptr();
  prm.x_stride = x.stride(0);
  prm.u = u.data_ptr();
  prm.u_stride = u.stride(0);
  prm.weight = weight.data_ptr<float>();
  prm.bias = bias.data_ptr<float>();
  prm.mean = mean.data_ptr<float>();
  prm.rstd = rstd.data_ptr<float>();
  prm.dx = dx.data_ptr();
  prm.du = du_out.has_value() ? du_out->data_ptr() : du.data_ptr();
  prm.du_stride = du_out.has_value() ? du_out->stride(0) : cols;
  prm.u_silu = u_silu;
  prm.y = recompute_y ? y.data_ptr() : nullptr;
  prm.partials = partials.data_ptr<float>();
  prm.rows = t;
  prm.cols = cols;
  prm.dropout = drop;
  lnmd::launch_bwd(dt, prm, grid, at::cuda::getCurrentCUDAStream());
  check_launch();
  auto sums = sum_partials(partials, 2);  // dweight, dbias
  return {dx, du, sums[0], sums[1], y};
}

// A [T, D] fp32 tensor of the input LayerNorm (x or dres), shaped like x.
void check_f32_rows(const Tensor& t, const char* name, const Tensor& x) {
  const std::string n(name);
  LNMD_VALUE(t.is_cuda(), n + " must be a CUDA tensor; got device " + t.device().str());
  LNMD_VALUE(t.device() == x.device(), n + " is on " + t.device().str() + " but x is on " +
                                           x.device().str());
  LNMD_TYPE(t.scalar_type() == at::kFloat, n + " must be float32 (the residual stream); got " +
                                               dtype_of(t));
  LNMD_VALUE(t.dim() == 2, n + " must be 2-D [T, D]; got shape " + shape_of(t));
  LNMD_VALUE(t.size(0) == x.size(0) && t.size(1) == x.size(1),
             n + " has shape " + shape_of(t) + " but x has " + shape_of(x));
  if (t.size(0) == 0) return;
  LNMD_VALUE(t.stride(1) == 1, n + " must have a contiguous last dim (stride 1); got stride " +
                                   std::to_string(t.stride(1)) + " (call .contiguous())");
  LNMD_VALUE(t.size(0) == 1 || (t.stride(0) >= t.size(1) && t.stride(0) % 8 == 0),
             n + " row stride must be >= D and a multiple of 8 elements; got " +
                 std::to_string(t.stride(0)) + " (call .contiguous())");
  LNMD_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
             n + " must start 16-byte aligned (call .contiguous())");
}

std::tuple<Tensor, Tensor, Tensor> ln_fwd_cuda(const Tensor& x, const Tensor& weight,
                                               const Tensor& bias, double eps,
                                               c10::ScalarType dtype) {
  check_f32_rows(x, "x", x);
  check_width(x);
  check_vec(weight, "weight", x.size(1), x);
  check_vec(bias, "bias", x.size(1), x);
  LNMD_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf,
            std::string("ln_fwd: dtype must be bfloat16 or float16; got ") + c10::toString(dtype));
  LNMD_VALUE(std::isfinite(eps) && eps > 0.0, "eps must be finite and > 0; got " +
                                                  std::to_string(eps));
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0);
  auto n = at::empty({t, x.size(1)}, x.options().dtype(dtype));
  auto mean = at::empty({t}, x.options());
  auto rstd = at::empty({t}, x.options());
  if (t == 0) return {n, mean, rstd};
  lnmd::LnFwdParams prm;
  prm.x = x.data_ptr<float>();
  prm.x_stride = x.stride(0);
  prm.weight = weight.data_ptr<float>();
  prm.bias = bias.data_ptr<float>();
  prm.n = n.data_ptr();
  prm.mean = mean.data_ptr<float>();
  prm.rstd = rstd.data_ptr<float>();
  prm.rows = t;
  prm.cols = static_cast<int>(x.size(1));
  prm.eps = static_cast<float>(eps);
  lnmd::launch_ln_fwd(dtype_enum(n), prm, num_sms(x), at::cuda::getCurrentCUDAStream());
  check_launch();
  return {n, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> ln_bwd_cuda(const Tensor& dn, const Tensor& x,
                                               const Tensor& mean, const Tensor& rstd,
                                               const Tensor& weight, const Tensor& dres) {
  check_f32_rows(x, "x", x);
  check_f32_rows(dres, "dres", x);
  LNMD_TYPE(dn.scalar_type() == at::kBFloat16 || dn.scalar_type() == at::kHalf,
            "dn must be bfloat16 or float16; got " + dtype_of(dn));
  check_rows(dn, "dn", dn);
  LNMD_VALUE(dn.device() == x.device(), "dn is on " + dn.device().str() + " but x is on " +
                                            x.device().str());
  LNMD_VALUE(dn.size(0) == x.size(0) && dn.size(1) == x.size(1),
             "dn has shape " + shape_of(dn) + " but x has " + shape_of(x));
  check_width(x);
  check_vec(weight, "weight", x.size(1), x);
  check_vec(mean, "mean", x.size(0), x);
  check_vec(rstd, "rstd", x.size(0), x);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t t = x.size(0);
  const int cols = static_cast<int>(x.size(1));
  auto dx = at::empty({t, cols}, x.options());
  if (t == 0) return {dx, at::zeros({cols}, weight.options()), at::zeros({cols}, weight.options())};
  const lnmd::DType dt = dtype_enum(dn);
  const int grid = lnmd::ln_bwd_grid(dt, cols, t, num_sms(x));
  auto partials = at::empty({grid, 2, cols}, x.options());
  lnmd::LnBwdParams prm;
  prm.dn = dn.data_ptr();
  prm.dn_stride = dn.stride(0);
  prm.x = x.data_ptr<float>();
  prm.x_stride = x.stride(0);
  prm.dres = dres.data_ptr<float>();
  prm.dres_stride = dres.stride(0);
  prm.weight = weight.data_ptr<float>();
  prm.mean = mean.data_ptr<float>();
  prm.rstd = rstd.data_ptr<float>();
  prm.dx = dx.data_ptr<float>();
  prm.partials = partials.data_ptr<float>();
  prm.rows = t;
  prm.cols = cols;
  lnmd::launch_ln_bwd(dt, prm, grid, at::cuda::getCurrentCUDAStream());
  check_launch();
  auto sums = sum_partials(partials, 2);  // dweight, dbias
  return {dx, sums[0], sums[1]};
}

std::tuple<Tensor, Tensor, Tensor> ln_fwd_meta(const Tensor& x, const Tensor& weight,
                                               const Tensor& bias, double eps,
                                               c10::ScalarType dtype) {
  const auto t = x.sym_size(0);
  return {at::empty_symint(x.sym_sizes(), x.options().dtype(dtype)),
          at::empty_symint({t}, x.options().dtype(at::kFloat)),
          at::empty_symint({t}, x.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor, Tensor> ln_bwd_meta(const Tensor& dn, const Tensor& x,
                                               const Tensor& mean, const Tensor& rstd,
                                               const Tensor& weight, const Tensor& dres) {
  return {at::empty_symint(x.sym_sizes(), x.options().dtype(at::kFloat)),
          at::empty_like(weight), at::empty_like(weight)};
}

// A 2-D 16-bit tensor the SiLU kernels read with 16-byte vectors (shape checked by the caller).
void check_silu_rows(const Tensor& t, const char* name, const Tensor& z) {
  const std::string n(name);
  LNMD_VALUE(t.is_cuda(), n + " must be a CUDA tensor; got device " + t.device().str());
  LNMD_VALUE(t.device() == z.device(), n + " is on " + t.device().str() + " but z is on " +
                                           z.device().str());
  LNMD_TYPE(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
            n + " must be bfloat16 or float16; got " + dtype_of(t) +
                " (the fused layer falls back to aten.silu for other dtypes)");
  LNMD_TYPE(t.scalar_type() == z.scalar_type(),
            n + " has dtype " + dtype_of(t) + " but z has " + dtype_of(z));
  LNMD_VALUE(t.dim() == 2, n + " must be 2-D; got shape " + shape_of(t));
  if (t.size(0) == 0) return;
  LNMD_VALUE(t.stride(1) == 1, n + " must have a contiguous last dim (stride 1); got stride " +
                                   std::to_string(t.stride(1)) + " (call .contiguous())");
  LNMD_VALUE(t.size(0) == 1 || (t.stride(0) >= t.size(1) && t.stride(0) % 8 == 0),
             n + " row stride must be >= its width and a multiple of 8 elements; got " +
                 std::to_string(t.stride(0)) + " (call .contiguous())");
  LNMD_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
             n + " must start 16-byte aligned (call .contiguous())");
}

// hd of z [T, 4*hd], checked: a multiple of 8 (one 16-byte chunk never straddles two blocks).
int64_t silu_hd(const Tensor& z) {
  check_silu_rows(z, "z", z);
  const int64_t w = z.size(1);
  LNMD_VALUE(w % 32 == 0 && w > 0 && w <= (int64_t(1) << 28),
             "z must be [T, 4 * hd] with hd a multiple of 8; got shape " + shape_of(z) +
                 " (hd = " + std::to_string(w / 4) + "; other widths: the aten.silu path)");
  return w / 4;
}

void check_first_block(int64_t first_block) {
  LNMD_VALUE(first_block == 0 || first_block == 1,
             "first_block must be 0 (u, v, q, k) or 1 (v, q, k); got " +
                 std::to_string(first_block));
}

Tensor silu_fwd_cuda(const Tensor& z, int64_t first_block) {
  const int64_t hd = silu_hd(z);
  check_first_block(first_block);
  const c10::cuda::CUDAGuard guard(z.device());
  const int64_t t = z.size(0);
  auto act = at::empty({4 - first_block, t, hd}, z.options());
  if (t == 0) return act;
  lnmd::SiluFwdParams prm;
  prm.z = z.data_ptr();
  prm.z_stride = z.stride(0);
  prm.act = act.data_ptr();
  prm.rows = t;
  prm.hd = static_cast<int>(hd);
  prm.first_block = static_cast<int>(first_block);
  lnmd::launch_silu_fwd(dtype_enum(z), prm, num_sms(z), at::cuda::getCurrentCUDAStream());
  check_launch();
  return act;
}

// The SiLU backward into dz. du == nullptr: block 0 of dz already holds dz_u (the gating
// backward with u_silu wrote it) and is only summed for the bias.
Tensor silu_bwd_core(const Tensor* du_p, const Tensor& dv, const Tensor& dq, const Tensor& dk,
                     const Tensor& z, const Tensor& dz, bool bias_grad) {
  const int64_t hd = z.size(1) / 4;
  const int64_t t = z.size(0);
  const Tensor& du = du_p != nullptr ? *du_p : dv;  // dv stands in (unchecked, unread)
  const Tensor* grads[4] = {&du, &dv, &dq, &dk};
  const char* names[4] = {"du", "dv", "dq", "dk"};
  // dq may be the attention backward's fp32 accumulator, head-major [H, T, D] with H * D = hd
  const bool dq_f32 = dq.scalar_type() == at::kFloat;
  if (dq_f32) {
    LNMD_VALUE(dq.is_cuda() && dq.device() == z.device(),
               "dq must be on z's device " + z.device().str() + "; got " + dq.device().str());
    LNMD_VALUE(dq.dim() == 3 && dq.size(1) == t && dq.size(0) * dq.size(2) == hd &&
                   dq.size(2) % 8 == 0,
               "an fp32 dq must be the attention's head-major [H, T, D] accumulator with H * D = "
               "hd = " + std::to_string(hd) + ", T = " + std::to_string(t) +
                   " and D a multiple of 8; got shape " + shape_of(dq) +
                   " (or pass dq as [T, hd] in z's dtype)");
    LNMD_VALUE(dq.is_contiguous() && reinterpret_cast<uintptr_t>(dq.data_ptr()) % 16 == 0,
               "an fp32 dq must be contiguous and 16-byte aligned (call .contiguous())");
  }
  for (int i = 0; i < 4; ++i) {
    if ((i == 2 && dq_f32) || (i == 0 && du_p == nullptr)) continue;
    check_silu_rows(*grads[i], names[i], z);
    LNMD_VALUE(grads[i]->size(0) == t && grads[i]->size(1) == hd,
               std::string(names[i]) + " must be [T, hd] = [" + std::to_string(t) + ", " +
                   std::to_string(hd) + "] for z of shape " + shape_of(z) + "; got " +
                   shape_of(*grads[i]));
  }
  const auto fopts = z.options().dtype(at::kFloat);
  if (t == 0) return bias_grad ? at::zeros({4 * hd}, fopts) : at::empty({0}, fopts);
  const lnmd::DType dt = dtype_enum(z);
  const int grid_y = lnmd::silu_bwd_grid(dt, static_cast<int>(hd), t, num_sms(z), dq_f32);
  Tensor partials = bias_grad ? at::empty({grid_y, 4 * hd}, fopts) : Tensor();
  lnmd::SiluBwdParams prm;
  prm.grad0 = du_p != nullptr ? du.data_ptr() : nullptr;
  prm.u_prefilled = du_p == nullptr;
  prm.grad1 = dv.data_ptr();
  prm.grad2 = dq_f32 ? nullptr : dq.data_ptr();
  prm.grad3 = dk.data_ptr();
  prm.grad2_f32 = dq_f32 ? dq.data_ptr<float>() : nullptr;
  prm.head_dim = dq_f32 ? static_cast<int>(dq.size(2)) : 0;
  prm.grad_stride0 = du.stride(0);
  prm.grad_stride1 = dv.stride(0);
  prm.grad_stride2 = dq_f32 ? 0 : dq.stride(0);
  prm.grad_stride3 = dk.stride(0);
  prm.z = z.data_ptr();
  prm.z_stride = z.stride(0);
  prm.dz = dz.data_ptr();
  prm.dz_stride = dz.stride(0);
  prm.partials = bias_grad ? partials.data_ptr<float>() : nullptr;
  prm.rows = t;
  prm.hd = static_cast<int>(hd);
  lnmd::launch_silu_bwd(dt, prm, grid_y, at::cuda::getCurrentCUDAStream());
  check_launch();
  return bias_grad ? sum_partials(partials, 1)[0] : at::empty({0}, fopts);
}

std::tuple<Tensor, Tensor> silu_bwd_cuda(const Tensor& du, const Tensor& dv, const Tensor& dq,
                                         const Tensor& dk, const Tensor& z, bool bias_grad) {
  const int64_t hd = silu_hd(z);
  const c10::cuda::CUDAGuard guard(z.device());
  auto dz = at::empty({z.size(0), 4 * hd}, z.options());
  Tensor dbias = silu_bwd_core(&du, dv, dq, dk, z, dz, bias_grad);
  return {dz, dbias};
}

// dz (given, [T, 4 * hd] in z's dtype) with its u block already written: the v, q, k blocks
// are written here, the bias gradient sums all four.
Tensor silu_bwd_into_cuda(const Tensor& dv, const Tensor& dq, const Tensor& dk, const Tensor& z,
                          const Tensor& dz, bool bias_grad) {
  const int64_t hd = silu_hd(z);
  check_silu_rows(dz, "dz", z);
  LNMD_VALUE(dz.size(0) == z.size(0) && dz.size(1) == 4 * hd,
             "dz must have z's shape " + shape_of(z) + "; got " + shape_of(dz));
  const c10::cuda::CUDAGuard guard(z.device());
  return silu_bwd_core(nullptr, dv, dq, dk, z, dz, bias_grad);
}

std::tuple<Tensor, Tensor> cast_colsum_cuda(const Tensor& x, c10::ScalarType dtype) {
  LNMD_VALUE(x.is_cuda(), "x must be a CUDA tensor; got device " + x.device().str());
  LNMD_TYPE(x.scalar_type() == at::kFloat,
            "cast_colsum: x must be float32; got " + dtype_of(x) + " (a 16-bit x needs no cast)");
  LNMD_TYPE(dtype == at::kBFloat16 || dtype == at::kHalf,
            std::string("cast_colsum: dtype must be bfloat16 or float16; got ") +
                c10::toString(dtype));
  LNMD_VALUE(x.dim() == 2, "cast_colsum: x must be 2-D [T, D]; got shape " + shape_of(x));
  const int64_t t = x.size(0), d = x.size(1);
  LNMD_VALUE(d % 8 == 0 && d > 0 && d <= (int64_t(1) << 28),
             "cast_colsum: D must be a positive multiple of 8; got shape " + shape_of(x));
  if (t > 0) {
    LNMD_VALUE(x.stride(1) == 1, "cast_colsum: x must have a contiguous last dim; got stride " +
                                     std::to_string(x.stride(1)) + " (call .contiguous())");
    LNMD_VALUE(t == 1 || (x.stride(0) >= d && x.stride(0) % 8 == 0),
               "cast_colsum: x row stride must be >= D and a multiple of 8; got " +
                   std::to_string(x.stride(0)) + " (call .contiguous())");
    LNMD_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
               "cast_colsum: x must start 16-byte aligned (call .contiguous())");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({t, d}, x.options().dtype(dtype));
  if (t == 0) return {y, at::zeros({d}, x.options())};
  const lnmd::DType dt = dtype == at::kBFloat16 ? lnmd::DType::kBF16 : lnmd::DType::kFP16;
  const int grid_y = lnmd::cast_colsum_grid(dt, static_cast<int>(d), t, num_sms(x));
  auto partials = at::empty({grid_y, d}, x.options());
  lnmd::CastColsumParams prm;
  prm.x = x.data_ptr<float>();
  prm.x_stride = x.stride(0);
  prm.y = y.data_ptr();
  prm.partials = partials.data_ptr<float>();
  prm.rows = t;
  prm.cols = static_cast<int>(d);
  lnmd::launch_cast_colsum(dt, prm, grid_y, at::cuda::getCurrentCUDAStream());
  check_launch();
  return {y, sum_partials(partials, 1)[0]};
}

// A 2-D operand of residual_gemm: its checks, with the fix in each message.
void check_gemm_operand(const Tensor& t, const char* name, const Tensor& x) {
  const std::string n(name);
  LNMD_VALUE(t.is_cuda(), "residual_gemm: " + n + " must be a CUDA tensor; got device " +
                              t.device().str());
  LNMD_VALUE(t.device() == x.device(), "residual_gemm: " + n + " is on " + t.device().str() +
                                           " but x is on " + x.device().str());
  LNMD_VALUE(t.dim() == 2, "residual_gemm: " + n + " must be 2-D; got shape " + shape_of(t));
  if (t.numel() == 0) return;
  LNMD_VALUE(t.stride(1) == 1, "residual_gemm: " + n +
                                   " must have a contiguous last dim (stride 1); got stride " +
                                   std::to_string(t.stride(1)) + " (call .contiguous())");
  LNMD_VALUE(t.size(0) == 1 || t.stride(0) >= t.size(1),
             "residual_gemm: " + n + " row stride must be >= its row length; got " +
                 std::to_string(t.stride(0)) + " for shape " + shape_of(t) +
                 " (call .contiguous())");
}

Tensor residual_gemm_cuda(const Tensor& x, const Tensor& y, const Tensor& w) {
  check_gemm_operand(x, "x", x);
  check_gemm_operand(y, "y", x);
  check_gemm_operand(w, "w", x);
  LNMD_TYPE(x.scalar_type() == at::kFloat,
            "residual_gemm: x (the residual stream) must be float32; got " + dtype_of(x));
  LNMD_TYPE(y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kHalf,
            "residual_gemm: y must be bfloat16 or float16; got " + dtype_of(y));
  LNMD_TYPE(w.scalar_type() == y.scalar_type(),
            "residual_gemm: w has dtype " + dtype_of(w) + " but y has " + dtype_of(y) +
                " (cast w to y's dtype)");
  LNMD_VALUE(y.size(0) == x.size(0), "residual_gemm: y has " + std::to_string(y.size(0)) +
                                         " rows but x has " + std::to_string(x.size(0)));
  LNMD_VALUE(w.size(0) == x.size(1) && w.size(1) == y.size(1),
             "residual_gemm: w must be [N, K] = [" + std::to_string(x.size(1)) + ", " +
                 std::to_string(y.size(1)) + "] for x " + shape_of(x) + " and y " + shape_of(y) +
                 "; got " + shape_of(w));
  LNMD_VALUE(x.size(1) > 0 && y.size(1) > 0,
             "residual_gemm: N and K must be positive; got x " + shape_of(x) + ", y " +
                 shape_of(y));
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.size(0) == 0) return out;
  lnmd::residual_gemm_lt(x, y, w, out);
  return out;
}

Tensor residual_gemm_meta(const Tensor& x, const Tensor& y, const Tensor& w) {
  return at::empty_symint(x.sym_sizes(), x.options().dtype(at::kFloat));
}

std::tuple<Tensor, Tensor> cast_colsum_meta(const Tensor& x, c10::ScalarType dtype) {
  return {at::empty_symint(x.sym_sizes(), x.options().dtype(dtype)),
          at::empty_symint({x.sym_size(1)}, x.options().dtype(at::kFloat))};
}

Tensor silu_fwd_meta(const Tensor& z, int64_t first_block) {
  check_first_block(first_block);
  return at::empty_symint({4 - first_block, z.sym_size(0), z.sym_size(1) / 4}, z.options());
}

Tensor silu_bwd_into_meta(const Tensor& dv, const Tensor& dq, const Tensor& dk, const Tensor& z,
                          const Tensor& dz, bool bias_grad) {
  const auto fopts = z.options().dtype(at::kFloat);
  return bias_grad ? at::empty_symint({z.sym_size(1)}, fopts) : at::empty({0}, fopts);
}

std::tuple<Tensor, Tensor> silu_bwd_meta(const Tensor& du, const Tensor& dv, const Tensor& dq,
                                         const Tensor& dk, const Tensor& z, bool bias_grad) {
  const auto fopts = z.options().dtype(at::kFloat);
  return {at::empty_symint(z.sym_sizes(), z.options()),
          bias_grad ? at::empty_symint({z.sym_size(1)}, fopts) : at::empty({0}, fopts)};
}

std::tuple<Tensor, Tensor, Tensor> fwd_meta(const Tensor& x, const Tensor& u, const Tensor& weight,
                                            const Tensor& bias, double eps, double p,
                                            int64_t seed, int64_t offset,
                                            const std::optional<Tensor>& seed_offset,
                                            bool u_silu, const std::optional<Tensor>& y_out) {
  const auto t = x.sym_size(0);
  return {y_out.has_value() ? at::empty({0}, x.options())
                            : at::empty_symint({t, x.sym_size(1)}, x.options()),
          at::empty_symint({t}, x.options().dtype(at::kFloat)),
          at::empty_symint({t}, x.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd_meta(
    const Tensor& dy, const Tensor& x, const Tensor& u, const Tensor& weight, const Tensor& bias,
    const Tensor& mean, const Tensor& rstd, double p, int64_t seed, int64_t offset,
    bool recompute_y, const std::optional<Tensor>& seed_offset, bool u_silu,
    const std::optional<Tensor>& du_out) {
  auto shape = x.sym_sizes();
  return {at::empty_symint(shape, x.options()),
          du_out.has_value() ? at::empty({0}, x.options()) : at::empty_symint(shape, x.options()),
          at::empty_like(weight), at::empty_like(bias),
          recompute_y ? at::empty_symint(shape, x.options()) : at::empty({0}, x.options())};
}

}  // namespace

TORCH_LIBRARY(hstu_lnmd, m) {
  m.def("fwd(Tensor x, Tensor u, Tensor weight, Tensor bias, float eps, float p, int seed, "
        "int offset, Tensor? seed_offset=None, bool u_silu=False, Tensor(a!)? y_out=None) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("bwd(Tensor dy, Tensor x, Tensor u, Tensor weight, Tensor bias, Tensor mean, "
        "Tensor rstd, float p, int seed, int offset, bool recompute_y, "
        "Tensor? seed_offset=None, bool u_silu=False, Tensor(a!)? du_out=None) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("silu_chunk_major(Tensor z, int first_block=0) -> Tensor");
  m.def("silu_chunk_major_backward(Tensor du, Tensor dv, Tensor dq, Tensor dk, Tensor z, "
        "bool bias_grad) -> (Tensor, Tensor)");
  m.def("silu_chunk_major_backward_into(Tensor dv, Tensor dq, Tensor dk, Tensor z, "
        "Tensor(a!) dz, bool bias_grad) -> Tensor");
  m.def("cast_colsum(Tensor x, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("residual_gemm(Tensor x, Tensor y, Tensor w) -> Tensor");
  m.def("ln_fwd(Tensor x, Tensor weight, Tensor bias, float eps, ScalarType dtype) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("ln_bwd(Tensor dn, Tensor x, Tensor mean, Tensor rstd, Tensor weight, Tensor dres) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hstu_lnmd, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("silu_chunk_major", &silu_fwd_cuda);
  m.impl("silu_chunk_major_backward", &silu_bwd_cuda);
  m.impl("silu_chunk_major_backward_into", &silu_bwd_into_cuda);
  m.impl("cast_colsum", &cast_colsum_cuda);
  m.impl("residual_gemm", &residual_gemm_cuda);
  m.impl("ln_fwd", &ln_fwd_cuda);
  m.impl("ln_bwd", &ln_bwd_cuda);
}

TORCH_LIBRARY_IMPL(hstu_lnmd, Meta, m) {
  m.impl("fwd", &fwd_meta);
  m.impl("bwd", &bwd_meta);
  m.impl("silu_chunk_major", &silu_fwd_meta);
  m.impl("silu_chunk_major_backward", &silu_bwd_meta);
  m.impl("silu_chunk_major_backward_into", &silu_bwd_into_meta);
  m.impl("cast_colsum", &cast_colsum_meta);
  m.impl("residual_gemm", &residual_gemm_meta);
  m.impl("ln_fwd", &ln_fwd_meta);
  m.impl("ln_bwd", &ln_bwd_meta);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "LayerNorm(x) * u * dropout and chunk-major SiLU kernels (ops under torch.ops.hstu_lnmd)";
}
