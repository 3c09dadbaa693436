// Torch face of the token-assembly kernels (tokens_kernel.h): checks before any launch, the
// schema (a fragment of namespace hstu_lnmd) with CUDA and Meta implementations.
//
//   tokens_fwd(values, item_scale, pos_weight, pos_ids, act_table, actions, action_index,
//              action_bits, ctx, row_src, p, seed, offset, seed_offset=None) -> x
//   tokens_bwd(grad, item_scale, dest, pos_order, pos_offsets, actions, action_index,
//              action_bits, ctx_rows, p, seed, offset, seed_offset=None)
//       -> (d_values, d_pos, d_act, d_ctx)
//
// values: fp32 [N, D] (row stride a multiple of 8, 16-byte aligned); pos_weight: fp32 [P, D];
// act_table: fp32 [2^action_bits, D]; ctx: fp32 [C, D]; grad: fp32 [rows, D] (as values);
// D a multiple of 8. Index tensors int64, contiguous: pos_ids, action_index, dest, pos_order
// [N]; actions [H]; row_src [rows]; pos_offsets [P + 1]; ctx_rows [C]. Their values come from
// the preprocessor's host layout and are not range-checked on the device: pos_ids < P,
// action_index < H or -1, row_src in [-2 - C, N), dest and ctx_rows < rows, pos_offsets
// non-decreasing from 0 to N. Actions are masked to action_bits, so any word is safe.
// d_act: fp32 [action_bits + 1, D], the sums of g over the history items with each action bit
// set (rows 0 .. bits - 1) and over all history items (row bits), summed in a fixed order.
// p, seed, offset, seed_offset: the dropout on x, as in the LayerNorm * u * dropout ops.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "launch.h"

namespace {

using at::Tensor;

[[noreturn]] void raise(bool type_error, const std::string& msg, const char* func, int line) {
  const std::string text = "assemble_tokens: " + msg;
  if (type_error) throw c10::TypeError({func, __FILE__, static_cast<uint32_t>(line)}, text);
  throw c10::ValueError({func, __FILE__, static_cast<uint32_t>(line)}, text);
}
#define TOK_VALUE(cond, msg) \
  do {                       \
    if (!(cond)) raise(false, (msg), __func__, __LINE__); \
  } while (0)
#define TOK_TYPE(cond, msg) \
  do {                      \
    if (!(cond)) raise(true, (msg), __func__, __LINE__); \
  } while (0)

std::string shape_of(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

void check_device(const Tensor& t, const std::string& name, const Tensor& ref) {
  TOK_VALUE(t.is_cuda() && t.device() == ref.device(),
            name + " must be on " + ref.device().str() + "; got " + t.device().str());
}

// An fp32 [rows, D] operand read with 16-byte vectors (rows may be `rows` or any count if < 0).
void check_rows(const Tensor& t, const std::string& name, const Tensor& ref, int64_t d,
                int64_t rows, bool any_stride) {
  check_device(t, name, ref);
  TOK_TYPE(t.scalar_type() == at::kFloat,
           name + " must be float32; got " + std::string(c10::toString(t.scalar_type())));
  TOK_VALUE(t.dim() == 2 && t.size(1) == d && (rows < 0 || t.size(0) == rows),
            name + " must be [" + (rows < 0 ? std::string("*") : std::to_string(rows)) + ", " +
                std::to_string(d) + "]; got " + shape_of(t));
  if (t.numel() == 0) return;
  const bool rows_ok = any_stride ? (t.size(0) == 1 || (t.stride(0) >= d && t.stride(0) % 8 == 0))
                                  : t.is_contiguous();
  TOK_VALUE(t.stride(1) == 1 && rows_ok,
            name + (any_stride ? " must have a contiguous last dim and a row stride that is a "
                                 "multiple of 8"
                               : " must be contiguous") +
                " (call .contiguous())");
  TOK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
            name + " must start 16-byte aligned (call .contiguous())");
}

void check_index(const Tensor& t, const std::string& name, const Tensor& ref, int64_t n) {
  check_device(t, name, ref);
  TOK_TYPE(t.scalar_type() == at::kLong,
           name + " must be int64; got " + std::string(c10::toString(t.scalar_type())));
  TOK_VALUE(t.dim() == 1 && t.is_contiguous() && (n < 0 || t.size(0) == n),
            name + " must be a contiguous 1-D tensor" +
                (n < 0 ? std::string() : " of " + std::to_string(n) + " elements") + "; got " +
                shape_of(t));
}

int64_t width(const Tensor& t) {
  TOK_VALUE(t.dim() == 2, "values / grad must be 2-D [rows, D]; got " + shape_of(t));
  const int64_t d = t.size(1);
  TOK_VALUE(d > 0 && d % 8 == 0 && d <= (int64_t(1) << 24),
            "D must be a positive multiple of 8; got D=" + std::to_string(d) +
                " (other widths take the PyTorch path)");
  return d;
}

lnmd::Dropout dropout_of(double p, int64_t seed, int64_t offset,
                         const std::optional<Tensor>& seed_offset, const Tensor& ref) {
  TOK_VALUE(std::isfinite(p) && p >= 0.0 && p < 1.0,
            "dropout p must be in [0, 1); got " + std::to_string(p));
  lnmd::Dropout d =
      lnmd::make_dropout_params(p, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
  if (seed_offset.has_value()) {
    check_index(*seed_offset, "seed_offset", ref, 2);
    d.seed_offset = seed_offset->data_ptr<int64_t>();
  }
  return d;
}

void check_bits(int64_t bits, int64_t d) {
  const int max_bits = lnmd::tokens_max_bits(static_cast<int>(d));
  TOK_VALUE(bits >= 1 && bits <= 30 && bits <= max_bits,
            "action_bits must be in [1, " + std::to_string(std::max(0, max_bits)) + "] at D=" +
                std::to_string(d) + "; got " + std::to_string(bits) +
                " (wider action words take the PyTorch path)");
}

int num_sms(const Tensor& x) {
  return at::cuda::getDeviceProperties(x.device().index())->multiProcessorCount;
}

void check_launch() {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess,
              std::string("assemble_tokens: kernel launch failed: ") + cudaGetErrorString(err));
}

Tensor tokens_fwd_cuda(const Tensor& values, double item_scale, const Tensor& pos_weight,
                       const Tensor& pos_ids, const Tensor& act_table, const Tensor& actions,
                       const Tensor& action_index, int64_t action_bits, const Tensor& ctx,
                       const Tensor& row_src, double p, int64_t seed, int64_t offset,
                       const std::optional<Tensor>& seed_offset) {
  TOK_VALUE(values.is_cuda(), "values must be a CUDA tensor; got " + values.device().str());
  const int64_t d = width(values);
  const int64_t n = values.size(0);
  check_rows(values, "values", values, d, -1, true);
  check_rows(pos_weight, "pos_weight", values, d, -1, false);
  check_bits(action_bits, d);
  check_rows(act_table, "act_table", values, d, int64_t(1) << action_bits, false);
  check_rows(ctx, "ctx", values, d, -1, false);
  check_index(pos_ids, "pos_ids", values, n);
  check_index(action_index, "action_index", values, n);
  check_index(actions, "actions", values, -1);
  check_index(row_src, "row_src", values, -1);
  TOK_VALUE(pos_weight.size(0) > 0 || n == 0, "pos_weight has no rows");
  const c10::cuda::CUDAGuard guard(values.device());
  const lnmd::Dropout drop = dropout_of(p, seed, offset, seed_offset, values);
  auto x = at::empty({row_src.size(0), d}, values.options());
  if (x.numel() == 0) return x;
  lnmd::TokensFwdParams prm;
  prm.values = values.data_ptr<float>();
  prm.values_stride = values.stride(0);
  prm.pos_weight = pos_weight.data_ptr<float>();
  prm.pos_ids = pos_ids.data_ptr<int64_t>();
  prm.act_table = act_table.data_ptr<float>();
  prm.actions = actions.data_ptr<int64_t>();
  prm.action_index = action_index.data_ptr<int64_t>();
  prm.action_mask = (int64_t(1) << action_bits) - 1;
  prm.ctx = ctx.data_ptr<float>();
  prm.row_src = row_src.data_ptr<int64_t>();
  prm.x = x.data_ptr<float>();
  prm.rows = x.size(0);
  prm.cols = static_cast<int>(d);
  prm.item_scale = static_cast<float>(item_scale);
  prm.scale_items = item_scale != 1.0;
  prm.dropout = drop;
  lnmd::launch_tokens_fwd(prm, num_sms(values), at::cuda::getCurrentCUDAStream());
  check_launch();
  return x;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> tokens_bwd_cuda(
    const Tensor& grad, double item_scale, const Tensor& dest, const Tensor& pos_order,
    const Tensor& pos_offsets, const Tensor& actions, const Tensor& action_index,
    int64_t action_bits, const Tensor& ctx_rows, double p, int64_t seed, int64_t offset,
    const std::optional<Tensor>& seed_offset) {
  TOK_VALUE(grad.is_cuda(), "grad must be a CUDA tensor; got " + grad.device().str());
  const int64_t d = width(grad);
  check_rows(grad, "grad", grad, d, -1, true);
  check_bits(action_bits, d);
  const int64_t n = dest.size(0);
  check_index(dest, "dest", grad, -1);
  check_index(pos_order, "pos_order", grad, n);
  check_index(action_index, "action_index", grad, n);
  check_index(actions, "actions", grad, -1);
  check_index(pos_offsets, "pos_offsets", grad, -1);
  check_index(ctx_rows, "ctx_rows", grad, -1);
  TOK_VALUE(pos_offsets.size(0) >= 1, "pos_offsets must hold P + 1 >= 1 offsets");
  const c10::cuda::CUDAGuard guard(grad.device());
  const lnmd::Dropout drop = dropout_of(p, seed, offset, seed_offset, grad);
  const int64_t positions = pos_offsets.size(0) - 1;
  const int64_t nctx = ctx_rows.size(0);
  const auto opts = grad.options();
  auto d_values = at::empty({n, d}, opts);
  auto d_pos = at::empty({positions, d}, opts);
  auto d_ctx = at::empty({nctx, d}, opts);
  auto d_act = at::empty({action_bits + 1, d}, opts);
  const int64_t work = positions + nctx;
  if (work == 0) return {d_values, d_pos, d_act.zero_(), d_ctx};
  const auto shape =
      lnmd::tokens_bwd_shape(static_cast<int>(d), static_cast<int>(action_bits), work, num_sms(grad));
  const int64_t groups = int64_t(shape.grid) * shape.ty;
  auto partials = at::empty({groups, action_bits + 1, d}, opts);
  lnmd::TokensBwdParams prm;
  prm.grad = grad.data_ptr<float>();
  prm.grad_stride = grad.stride(0);
  prm.dest = dest.data_ptr<int64_t>();
  prm.pos_order = pos_order.data_ptr<int64_t>();
  prm.pos_offsets = pos_offsets.data_ptr<int64_t>();
  prm.actions = actions.data_ptr<int64_t>();
  prm.action_index = action_index.data_ptr<int64_t>();
  prm.action_mask = (int64_t(1) << action_bits) - 1;
  prm.num_bits = static_cast<int>(action_bits);
  prm.ctx_rows = ctx_rows.data_ptr<int64_t>();
  prm.num_ctx = nctx;
  prm.num_positions = positions;
  prm.d_values = d_values.data_ptr<float>();
  prm.d_pos = d_pos.data_ptr<float>();
  prm.d_ctx = d_ctx.data_ptr<float>();
  prm.partials = partials.data_ptr<float>();
  prm.cols = static_cast<int>(d);
  prm.item_scale = static_cast<float>(item_scale);
  prm.scale_items = item_scale != 1.0;
  prm.dropout = drop;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  lnmd::launch_tokens_bwd(prm, shape, stream);
  check_launch();
  // the lane groups' sums in a fixed order (bitwise reproducible)
  lnmd::SumPartialsParams sums;
  sums.partials = partials.data_ptr<float>();
  sums.rows = static_cast<int>(groups);
  sums.width = static_cast<int>((action_bits + 1) * d);
  sums.cols = sums.width;
  sums.outs[0] = d_act.data_ptr<float>();
  lnmd::launch_sum_partials(sums, stream);
  check_launch();
  return {d_values, d_pos, d_act, d_ctx};
}

Tensor tokens_fwd_meta(const Tensor& values, double item_scale, const Tensor& pos_weight,
                       const Tensor& pos_ids, const Tensor& act_table, const Tensor& actions,
                       const Tensor& action_index, int64_t action_bits, const Tensor& ctx,
                       const Tensor& row_src, double p, int64_t seed, int64_t offset,
                       const std::optional<Tensor>& seed_offset) {
  return at::empty_symint({row_src.sym_size(0), values.sym_size(1)}, values.options());
}

std::tuple<Tensor, Tensor, Tensor, Tensor> tokens_bwd_meta(
    const Tensor& grad, double item_scale, const Tensor& dest, const Tensor& pos_order,
    const Tensor& pos_offsets, const Tensor& actions, const Tensor& action_index,
    int64_t action_bits, const Tensor& ctx_rows, double p, int64_t seed, int64_t offset,
    const std::optional<Tensor>& seed_offset) {
  const auto d = grad.sym_size(1);
  const auto opts = grad.options();
  return {at::empty_symint({dest.sym_size(0), d}, opts),
          at::empty_symint({pos_offsets.sym_size(0) - 1, d}, opts),
          at::empty_symint({c10::SymInt(action_bits + 1), d}, opts),
          at::empty_symint({ctx_rows.sym_size(0), d}, opts)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hstu_lnmd, m) {
  m.def("tokens_fwd(Tensor values, float item_scale, Tensor pos_weight, Tensor pos_ids, "
        "Tensor act_table, Tensor actions, Tensor action_index, int action_bits, Tensor ctx, "
        "Tensor row_src, float p, int seed, int offset, Tensor? seed_offset=None) -> Tensor");
  m.def("tokens_bwd(Tensor grad, float item_scale, Tensor dest, Tensor pos_order, "
        "Tensor pos_offsets, Tensor actions, Tensor action_index, int action_bits, "
        "Tensor ctx_rows, float p, int seed, int offset, Tensor? seed_offset=None) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hstu_lnmd, CUDA, m) {
  m.impl("tokens_fwd", &tokens_fwd_cuda);
  m.impl("tokens_bwd", &tokens_bwd_cuda);
}

TORCH_LIBRARY_IMPL(hstu_lnmd, Meta, m) {
  m.impl("tokens_fwd", &tokens_fwd_meta);
  m.impl("tokens_bwd", &tokens_bwd_meta);
}
