// Torch face of the HSTU attention kernels: input checks (before any launch), the
// TORCH_LIBRARY schema with CUDA and Meta implementations, and the Python module stub.
//
//   torch.ops.hstu_attention.fwd(q, k, v, seq_offsets, max_seqlen, num_contexts, num_targets,
//                                target_group_size, window_size, alpha, inv_scale, causal,
//                                timestamps=None, pos_weight=None, time_weight=None,
//                                time_edges=None, max_pos=0, last_query_time=None,
//                                inv_scale_tensor=None) -> out
//   torch.ops.hstu_attention.bwd(dout, q, k, v, seq_offsets, max_seqlen, num_contexts,
//                                num_targets, target_group_size, window_size, alpha, inv_scale,
//                                causal, deterministic, timestamps=None, pos_weight=None,
//                                time_weight=None, time_edges=None, max_pos=0,
//                                last_query_time=None, inv_scale_tensor=None, dq_fp32=False)
//                                -> (dq, dk, dv, d_pos_weight, d_time_weight)
//     dq_fp32: dq is returned as the kernel's fp32 accumulator, head-major [H, T, D], unconverted
//     (the fused layer's SiLU backward reads it; saves the convert kernel's pass).
//   torch.ops.hstu_attention.fwd_cached(q, k, v, q_offsets, kv_offsets, kv_lengths,
//                                num_contexts, num_targets, target_group_size, window_size,
//                                alpha, inv_scale, timestamps=None, pos_weight=None,
//                                time_weight=None, time_edges=None, max_pos=0,
//                                last_query_time=None, max_q_seqlen=0, max_seqlen=0,
//                                num_splits=1) -> out
//     forward only: each sequence's last queries against its whole k/v (inference with a KV
//     cache; see fwd_cached_cuda). Under CUDA graph capture the metadata must be on the GPU and
//     the two maxima (longest query run, longest sequence) size the grid. num_splits > 1 splits
//     each query block's keys over that many CTAs (fp32 partial outputs added, then converted;
//     the sum order, so the last bits, vary between runs); 0 chooses per call (key_splits).
// The optional arguments are the relative attention bias (bias.h, docs/design.md); the weight
// gradients are empty tensors for an absent weight. inv_scale_tensor: float32 [1] on q's device,
// read by the kernels in place of inv_scale.
//
// Under CUDA graph capture (hstu.modules.graphed_encoder) the metadata must be on the GPU and is
// taken as given: max_seqlen is an upper bound of the sequence lengths that sizes the grid, and the
// caller validates every batch's metadata on the host before it replays the graph. Outside capture
// every call validates the metadata itself (below).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "../common/error_message.h"
#include "launch_registry.h"
#include "params.h"

namespace {

using at::Tensor;
constexpr int kMinBlockM = 64;  // smallest backward query tile (dQ semaphore rows)
constexpr int64_t kMaxSeqLen = int64_t(65535) * 64;  // at most 65535 blocks of >= 64 tokens

// Input checks: messages built without iostreams (kernels/common/error_message.h says why).
#define HSTU_CHECK(cond, ...) HSTU_RAISE_IF_NOT(Error, cond, __VA_ARGS__)
#define HSTU_CHECK_VALUE(cond, ...) HSTU_RAISE_IF_NOT(ValueError, cond, __VA_ARGS__)
#define HSTU_CHECK_TYPE(cond, ...) HSTU_RAISE_IF_NOT(TypeError, cond, __VA_ARGS__)

std::string shape_str(const Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

void check_qkv(const Tensor& t, const char* name, const Tensor& q) {
  HSTU_CHECK_VALUE(t.is_cuda(), "hstu_attention: ", name, " must be a CUDA tensor; got ", t.device());
  HSTU_CHECK_VALUE(t.device() == q.device(), "hstu_attention: ", name, " is on ", t.device(),
              " but q is on ", q.device());
  HSTU_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "hstu_attention: ", name, " must be float16 or bfloat16; got ", t.scalar_type());
  HSTU_CHECK_TYPE(t.scalar_type() == q.scalar_type(), "hstu_attention: ", name, " has dtype ",
              t.scalar_type(), " but q has ", q.scalar_type());
  HSTU_CHECK_VALUE(t.dim() == 3, "hstu_attention: ", name, " must be jagged [T, H, D]; got shape ",
              shape_str(t));
  HSTU_CHECK_VALUE(t.is_contiguous(), "hstu_attention: ", name,
              " must be contiguous (call .contiguous()); got strides ", t.strides());
  HSTU_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "hstu_attention: ", name,
              " must be 16-byte aligned");
}

struct Checked {
  int batch;
  int64_t max_len;
  Tensor cu32;
  Tensor ctx32;
  Tensor tgt32;
};

// Per-call checks that need no device data: q/k/v tensors and the scalar arguments.
void check_tensors_and_scalars(const Tensor& q, const Tensor& k, const Tensor& v,
                               int64_t max_seqlen, const std::optional<Tensor>& num_contexts,
                               const std::optional<Tensor>& num_targets,
                               int64_t target_group_size, int64_t window_size, double alpha,
                               double inv_scale, bool causal) {
  check_qkv(q, "q", q);
  check_qkv(k, "k", q);
  check_qkv(v, "v", q);
  HSTU_CHECK_VALUE(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  v.size(1) == q.size(1),
              "hstu_attention: q, k, v must share [T, H]; got q", shape_str(q), " k",
              shape_str(k), " v", shape_str(v));
  HSTU_CHECK_VALUE(k.size(2) == q.size(2), "hstu_attention: q and k head dims differ: ", q.size(2),
              " vs ", k.size(2));
  HSTU_CHECK_VALUE(v.size(2) == q.size(2),
              "hstu_attention: the CUDA kernel requires Dqk == Dv; got Dqk=", q.size(2),
              " Dv=", v.size(2), " (use the reference implementation for Dqk != Dv)");
  const int64_t d = q.size(2);
  HSTU_CHECK_VALUE(d == 32 || d == 64 || d == 128 || d == 256,
              "hstu_attention: head dim ", d, " is not supported; supported: 32, 64, 128, 256");
  HSTU_CHECK_VALUE(q.size(1) >= 1 && q.size(1) <= 65535, "hstu_attention: number of heads ",
              q.size(1), " must be in [1, 65535]");
  HSTU_CHECK_VALUE(q.size(0) * q.size(1) * d < std::numeric_limits<int64_t>::max() / 4,
              "hstu_attention: tensor too large");
  HSTU_CHECK_VALUE(std::isfinite(alpha), "hstu_attention: alpha must be finite; got ", alpha);
  HSTU_CHECK_VALUE(std::isfinite(inv_scale) && inv_scale > 0,
              "hstu_attention: 1/scaling_seqlen must be finite and > 0; got ", inv_scale);
  HSTU_CHECK_VALUE(target_group_size >= 1, "hstu_attention: target_group_size must be >= 1; got ",
              target_group_size);
  HSTU_CHECK_VALUE(window_size >= 0, "hstu_attention: window_size must be >= 0 (0 = no window); got ",
              window_size);
  HSTU_CHECK_VALUE(window_size <= std::numeric_limits<int32_t>::max(),
              "hstu_attention: window_size out of int32 range: ", window_size);
  HSTU_CHECK_VALUE(max_seqlen >= 0 && max_seqlen <= std::numeric_limits<int32_t>::max(),
              "hstu_attention: max_seqlen must be in [0, 2^31); got ", max_seqlen);
  HSTU_CHECK_VALUE(causal || (!num_contexts.has_value() && !num_targets.has_value() && window_size == 0),
              "hstu_attention: causal=False does not combine with contexts, targets or a window");

}

// int32 copy on q's device of validated metadata (`host` holds its n values, int64). CPU
// metadata is staged in pinned memory and copied with non_blocking=true: a copy from pageable
// memory would make the host wait for the GPU. The caching host allocator keeps the staging block
// alive until the copy has run. GPU metadata is converted on the device.
Tensor to_device_int32(const Tensor& t, const int64_t* host, int64_t n, const Tensor& q) {
  if (!t.is_cpu()) return t.to(q.device(), at::kInt).contiguous();
  Tensor staged = at::empty({n}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  int32_t* dst = staged.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int32_t>(host[i]);
  return staged.to(q.device(), at::kInt, /*non_blocking=*/true, /*copy=*/false);
}

// Validates shapes, dtypes and the jagged metadata on the host. GPU metadata is copied to the
// host first (a device->host copy: the host waits for the GPU); CPU metadata (the models pass the
// batch's host copies, see AttentionInputs.kernel_metadata) costs no sync.
Checked check_inputs_uncached(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seq_offsets,
                     int64_t max_seqlen, const std::optional<Tensor>& num_contexts,
                     const std::optional<Tensor>& num_targets, int64_t target_group_size,
                     int64_t window_size, double alpha, double inv_scale, bool causal) {
  check_tensors_and_scalars(q, k, v, max_seqlen, num_contexts, num_targets, target_group_size,
                            window_size, alpha, inv_scale, causal);
  HSTU_CHECK_VALUE(seq_offsets.dim() == 1 && seq_offsets.numel() >= 1,
              "hstu_attention: seq_offsets must be 1-D [B+1]; got shape ", shape_str(seq_offsets));
  HSTU_CHECK_TYPE(seq_offsets.scalar_type() == at::kInt || seq_offsets.scalar_type() == at::kLong,
              "hstu_attention: seq_offsets must be int32 or int64; got ",
              seq_offsets.scalar_type());
  HSTU_CHECK_VALUE(seq_offsets.is_cpu() || seq_offsets.device() == q.device(),
              "hstu_attention: seq_offsets is on ", seq_offsets.device(), " but q is on ",
              q.device());
  const int64_t batch = seq_offsets.numel() - 1;
  HSTU_CHECK_VALUE(batch <= 65535, "hstu_attention: batch size ", batch, " exceeds 65535");
  Tensor offs = seq_offsets.to(at::kCPU, at::kLong).contiguous();
  const int64_t* o = offs.data_ptr<int64_t>();
  HSTU_CHECK_VALUE(o[0] == 0, "hstu_attention: seq_offsets[0] must be 0; got ", o[0]);
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = o[b + 1] - o[b];
    HSTU_CHECK_VALUE(len >= 0, "hstu_attention: seq_offsets must be non-decreasing; seq_offsets[", b,
                "]=", o[b], " > seq_offsets[", b + 1, "]=", o[b + 1]);
    max_len = std::max(max_len, len);
  }
  HSTU_CHECK_VALUE(o[batch] <= std::numeric_limits<int32_t>::max(),
              "hstu_attention: seq_offsets[-1]=", o[batch], " exceeds the int32 range");
  HSTU_CHECK_VALUE(o[batch] == q.size(0), "hstu_attention: seq_offsets[-1]=", o[batch],
              " != number of tokens T=", q.size(0));
  HSTU_CHECK_VALUE(max_len <= max_seqlen, "hstu_attention: a sequence has length ", max_len,
              " > max_seqlen=", max_seqlen);

  std::vector<int64_t> ctx(batch, 0), tgt(batch, 0);
  auto check_counts = [&](const std::optional<Tensor>& t, const char* name,
                          std::vector<int64_t>& out) -> Tensor {
    if (!t.has_value()) return Tensor();
    const Tensor& x = *t;
    HSTU_CHECK_VALUE(x.dim() == 1 && x.size(0) == batch, "hstu_attention: ", name,
                " must have shape [B]=[", batch, "]; got ", shape_str(x));
    HSTU_CHECK_TYPE(x.scalar_type() == at::kInt || x.scalar_type() == at::kLong, "hstu_attention: ",
                name, " must be int32 or int64; got ", x.scalar_type());
    HSTU_CHECK_VALUE(x.is_cpu() || x.device() == q.device(), "hstu_attention: ", name, " is on ",
                x.device(), " but q is on ", q.device());
    Tensor h = x.to(at::kCPU, at::kLong).contiguous();
    const int64_t* p = h.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = o[b + 1] - o[b];
      HSTU_CHECK_VALUE(p[b] >= 0 && p[b] <= len, "hstu_attention: ", name, "[", b, "]=", p[b],
                  " must be in [0, length=", len, "]");
      out[b] = p[b];
    }
    return to_device_int32(x, p, batch, q);
  };
  Checked c;
  c.ctx32 = check_counts(num_contexts, "num_contexts", ctx);
  c.tgt32 = check_counts(num_targets, "num_targets", tgt);
  for (int64_t b = 0; b < batch; ++b) {
    HSTU_CHECK_VALUE(ctx[b] + tgt[b] <= o[b + 1] - o[b], "hstu_attention: num_contexts[", b, "]=",
                ctx[b], " + num_targets[", b, "]=", tgt[b], " exceeds the sequence length ",
                o[b + 1] - o[b]);
  }
  c.batch = int(batch);
  c.max_len = max_len;
  c.cu32 = to_device_int32(seq_offsets, o, batch + 1, q);
  return c;
}

// The jagged metadata check needs the offsets on the host (a device sync for GPU metadata, a
// pinned host->device copy for CPU metadata). The same offsets tensor is passed to every layer's
// forward and backward of a step, so the result is cached per tensor object (CPU or GPU alike):
// an entry holds weak references to the offsets / num_contexts / num_targets TensorImpls and
// their version counters, and is reused only while all of them are alive and unmodified (an
// in-place write bumps the version and forces a new check).
struct CacheKey {
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl>;
  std::optional<WeakImpl> offs, ctx, tgt;
  int64_t offs_ver = 0, ctx_ver = 0, tgt_ver = 0;
  bool has_ctx = false, has_tgt = false;
  int64_t total = 0, max_seqlen = 0;
  c10::Device device{c10::kCPU};
};

bool cacheable(const Tensor& t) { return !t.is_inference(); }

bool same_tensor(const std::optional<CacheKey::WeakImpl>& w, const Tensor& t, int64_t ver) {
  if (!w.has_value()) return false;
  auto strong = w->lock();
  return strong.defined() && strong.get() == t.unsafeGetTensorImpl() && t._version() == ver;
}

std::mutex g_cache_mutex;
std::deque<std::pair<CacheKey, Checked>> g_cache;  // most recent first, at most kCacheSize
constexpr size_t kCacheSize = 16;

// Under CUDA graph capture: shapes, dtypes and devices only (no value can be read without a
// sync, and a replay runs with other values anyway); the lengths are bounded by max_seqlen, which
// sizes the grid. GPU metadata only: a captured copy from host memory would replay stale bytes.
Checked check_inputs_captured(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& seq_offsets, int64_t max_seqlen,
                              const std::optional<Tensor>& num_contexts,
                              const std::optional<Tensor>& num_targets, int64_t target_group_size,
                              int64_t window_size, double alpha, double inv_scale, bool causal) {
  check_tensors_and_scalars(q, k, v, max_seqlen, num_contexts, num_targets, target_group_size,
                            window_size, alpha, inv_scale, causal);
  auto on_gpu = [&](const Tensor& t, const char* name) {
    HSTU_CHECK_VALUE(t.device() == q.device(), "hstu_attention: under CUDA graph capture ", name,
                     " must be on q's device ", q.device(), " (its values are read at replay); "
                     "got ", t.device());
    HSTU_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                    "hstu_attention: ", name, " must be int32 or int64; got ", t.scalar_type());
    return t.to(at::kInt).contiguous();
  };
  HSTU_CHECK_VALUE(seq_offsets.dim() == 1 && seq_offsets.numel() >= 1,
                   "hstu_attention: seq_offsets must be 1-D [B+1]; got shape ",
                   shape_str(seq_offsets));
  const int64_t batch = seq_offsets.numel() - 1;
  HSTU_CHECK_VALUE(batch <= 65535, "hstu_attention: batch size ", batch, " exceeds 65535");
  HSTU_CHECK_VALUE(q.size(0) <= std::numeric_limits<int32_t>::max(),
                   "hstu_attention: ", q.size(0), " tokens exceed the int32 range");
  Checked c;
  c.cu32 = on_gpu(seq_offsets, "seq_offsets");
  for (auto [t, name, out] : {std::make_tuple(&num_contexts, "num_contexts", &c.ctx32),
                              std::make_tuple(&num_targets, "num_targets", &c.tgt32)}) {
    if (!t->has_value()) continue;
    HSTU_CHECK_VALUE((*t)->dim() == 1 && (*t)->size(0) == batch, "hstu_attention: ", name,
                     " must have shape [B]=[", batch, "]; got ", shape_str(**t));
    *out = on_gpu(**t, name);
  }
  c.batch = int(batch);
  c.max_len = max_seqlen;
  return c;
}

Checked check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seq_offsets,
                     int64_t max_seqlen, const std::optional<Tensor>& num_contexts,
                     const std::optional<Tensor>& num_targets, int64_t target_group_size,
                     int64_t window_size, double alpha, double inv_scale, bool causal) {
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return check_inputs_captured(q, k, v, seq_offsets, max_seqlen, num_contexts, num_targets,
                                 target_group_size, window_size, alpha, inv_scale, causal);
  }
  const bool has_ctx = num_contexts.has_value(), has_tgt = num_targets.has_value();
  const bool use_cache = cacheable(seq_offsets) && (!has_ctx || cacheable(*num_contexts)) &&
                         (!has_tgt || cacheable(*num_targets));
  if (use_cache) {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    for (auto& [key, val] : g_cache) {
      if (key.total != q.size(0) || key.max_seqlen != max_seqlen || key.device != q.device() ||
          key.has_ctx != has_ctx || key.has_tgt != has_tgt ||
          !same_tensor(key.offs, seq_offsets, key.offs_ver) ||
          (has_ctx && !same_tensor(key.ctx, *num_contexts, key.ctx_ver)) ||
          (has_tgt && !same_tensor(key.tgt, *num_targets, key.tgt_ver))) {
        continue;
      }
      Checked hit = val;
      // Metadata already verified (cache hit); the per-call (cheap, host-only) checks still run.
      check_tensors_and_scalars(q, k, v, max_seqlen, num_contexts, num_targets,
                                target_group_size, window_size, alpha, inv_scale, causal);
      return hit;
    }
  }
  Checked c = check_inputs_uncached(q, k, v, seq_offsets, max_seqlen, num_contexts, num_targets,
                                    target_group_size, window_size, alpha, inv_scale, causal);
  if (use_cache) {
    CacheKey key;
    key.offs.emplace(seq_offsets.getIntrusivePtr());
    key.offs_ver = seq_offsets._version();
    if (has_ctx) {
      key.ctx.emplace(num_contexts->getIntrusivePtr());
      key.ctx_ver = num_contexts->_version();
    }
    if (has_tgt) {
      key.tgt.emplace(num_targets->getIntrusivePtr());
      key.tgt_ver = num_targets->_version();
    }
    key.has_ctx = has_ctx;
    key.has_tgt = has_tgt;
    key.total = q.size(0);
    key.max_seqlen = max_seqlen;
    key.device = q.device();
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    g_cache.emplace_front(std::move(key), c);
    if (g_cache.size() > kCacheSize) g_cache.pop_back();
  }
  return c;
}

hstu::HstuParams make_params(const Tensor& q, const Checked& c, int64_t max_seqlen,
                             int64_t target_group_size, int64_t window_size, double alpha,
                             double inv_scale, bool causal) {
  hstu::HstuParams p;
  p.q = q.data_ptr();
  p.row_stride = q.size(1) * q.size(2);
  p.head_stride = q.size(2);
  p.cu_seqlens = c.cu32.data_ptr<int>();
  p.num_contexts = c.ctx32.defined() ? c.ctx32.data_ptr<int>() : nullptr;
  p.num_targets = c.tgt32.defined() ? c.tgt32.data_ptr<int>() : nullptr;
  p.batch = c.batch;
  p.heads = int(q.size(1));
  p.head_dim = int(q.size(2));
  // Grid size: only as many query/key blocks as the longest sequence needs, at most 65535 per
  // sequence, and one 1-D grid of B x H x blocks CTAs (launch.h), which must fit in int32.
  HSTU_CHECK_VALUE(c.max_len <= kMaxSeqLen, "hstu_attention: the CUDA kernel supports sequences of "
              "at most ", kMaxSeqLen, " tokens; the longest here has ", c.max_len,
              " (split it, or use hstu.ops.reference)");
  const int64_t ctas = int64_t(c.batch) * q.size(1) * ((c.max_len + kMinBlockM - 1) / kMinBlockM);
  HSTU_CHECK_VALUE(ctas <= int64_t(std::numeric_limits<int>::max()),
              "hstu_attention: batch ", c.batch, " x heads ", q.size(1), " x ",
              (c.max_len + kMinBlockM - 1) / kMinBlockM, " blocks of the longest sequence is more "
              "CTAs than one launch takes (2^31 - 1); split the batch");
  p.max_seqlen = int(std::min<int64_t>(max_seqlen, c.max_len));
  p.total = int(q.size(0));
  p.target_group_size = int(std::min<int64_t>(target_group_size, std::numeric_limits<int>::max()));
  p.window_size = int(window_size);
  p.alpha = float(alpha);
  p.inv_scale = float(inv_scale);
  p.causal = causal;
  p.dtype = q.scalar_type() == at::kBFloat16 ? hstu::DType::kBf16 : hstu::DType::kFp16;
  return p;
}

// The relative attention bias arguments, checked (see the schema comment at the top).
struct BiasArgs {
  std::optional<Tensor> timestamps, pos_w, time_w, edges;
  int64_t max_pos = 0;
  std::optional<Tensor> last_query_time;
  bool any() const { return pos_w.has_value() || time_w.has_value(); }
};

constexpr int64_t kMaxTimeBuckets = 256;  // bias.h kMaxTimeBuckets

void check_bias(const BiasArgs& b, const Tensor& q, double alpha, int64_t batch) {
  auto on_q_device = [&](const Tensor& t, const char* name) {
    HSTU_CHECK_VALUE(t.device() == q.device(), "hstu_attention: ", name, " is on ", t.device(),
                     " but q is on ", q.device());
    HSTU_CHECK_VALUE(t.is_contiguous(), "hstu_attention: ", name, " must be contiguous");
  };
  auto check_weight = [&](const Tensor& w, const char* name, int64_t cols, const char* what) {
    on_q_device(w, name);
    HSTU_CHECK_TYPE(w.scalar_type() == at::kFloat, "hstu_attention: ", name,
                    " must be float32; got ", w.scalar_type());
    HSTU_CHECK_VALUE(w.dim() == 2 && (w.size(0) == 1 || w.size(0) == q.size(1)) &&
                         w.size(1) == cols,
                     "hstu_attention: ", name, " must be [1 or H=", q.size(1), ", ", cols, "] (",
                     what, "); got ", shape_str(w));
  };
  if (!b.any()) {
    HSTU_CHECK_VALUE(!b.timestamps.has_value() && !b.edges.has_value() &&
                         !b.last_query_time.has_value(),
                     "hstu_attention: timestamps/time_edges/last_query_time given without "
                     "time_weight");
    return;
  }
  HSTU_CHECK_VALUE(alpha != 0.0, "hstu_attention: alpha must be != 0 with a relative attention "
                   "bias (the kernel adds bias / alpha to q.k)");
  if (b.pos_w.has_value()) {
    HSTU_CHECK_VALUE(b.max_pos >= 0 && b.max_pos <= std::numeric_limits<int32_t>::max() / 2,
                     "hstu_attention: max_pos must be in [0, 2^30); got ", b.max_pos);
    check_weight(*b.pos_w, "pos_weight", 2 * b.max_pos + 1, "2 * max_pos + 1 relative positions");
  }
  if (b.time_w.has_value()) {
    const Tensor& w = *b.time_w;
    HSTU_CHECK_VALUE(w.dim() == 2 && w.size(1) >= 2 && w.size(1) <= kMaxTimeBuckets + 1,
                     "hstu_attention: time_weight must be [Hw, num_buckets + 1] with num_buckets "
                     "in [1, ", kMaxTimeBuckets, "]; got ", shape_str(w));
    check_weight(w, "time_weight", w.size(1), "num_buckets + 1 time buckets");
    HSTU_CHECK_VALUE(b.timestamps.has_value() && b.edges.has_value(),
                     "hstu_attention: time_weight needs timestamps and time_edges");
    const Tensor& ts = *b.timestamps;
    on_q_device(ts, "timestamps");
    HSTU_CHECK_TYPE(ts.scalar_type() == at::kLong, "hstu_attention: timestamps must be int64; got ",
                    ts.scalar_type());
    HSTU_CHECK_VALUE(ts.dim() == 1 && ts.size(0) == q.size(0),
                     "hstu_attention: timestamps must be [T]=[", q.size(0), "] (one per token); got ",
                     shape_str(ts));
    const Tensor& e = *b.edges;
    on_q_device(e, "time_edges");
    HSTU_CHECK_TYPE(e.scalar_type() == at::kLong, "hstu_attention: time_edges must be int64; got ",
                    e.scalar_type());
    HSTU_CHECK_VALUE(e.dim() == 1 && e.size(0) == w.size(1),
                     "hstu_attention: time_edges must be [num_buckets + 1]=[", w.size(1),
                     "] (hstu.ops.reference.time_bucket_edges); got ", shape_str(e));
    if (b.last_query_time.has_value()) {
      const Tensor& lq = *b.last_query_time;
      on_q_device(lq, "last_query_time");
      HSTU_CHECK_TYPE(lq.scalar_type() == at::kLong,
                      "hstu_attention: last_query_time must be int64; got ", lq.scalar_type());
      HSTU_CHECK_VALUE(lq.dim() == 1 && lq.size(0) == batch,
                       "hstu_attention: last_query_time must be [B]=[", batch,
                       "] (one per sequence); got ", shape_str(lq));
    }
  } else {
    HSTU_CHECK_VALUE(!b.timestamps.has_value() && !b.edges.has_value() &&
                         !b.last_query_time.has_value(),
                     "hstu_attention: timestamps/time_edges/last_query_time given without "
                     "time_weight");
  }
}

void set_bias_params(hstu::HstuParams& p, const BiasArgs& b, double alpha) {
  if (!b.any()) return;
  p.inv_alpha = float(1.0 / alpha);
  if (b.pos_w.has_value()) {
    p.pos_w = b.pos_w->data_ptr<float>();
    p.pos_w_head_stride = b.pos_w->size(0) == 1 ? 0 : b.pos_w->size(1);
    p.max_pos = int(b.max_pos);
  }
  if (b.time_w.has_value()) {
    p.time_w = b.time_w->data_ptr<float>();
    p.time_w_head_stride = b.time_w->size(0) == 1 ? 0 : b.time_w->size(1);
    p.num_buckets = int(b.time_w->size(1) - 1);
    p.timestamps = b.timestamps->data_ptr<int64_t>();
    p.time_edges = b.edges->data_ptr<int64_t>();
    if (b.last_query_time.has_value()) p.last_query_time = b.last_query_time->data_ptr<int64_t>();
  }
}

// The device-side 1 / scaling_seqlen, checked; nullptr when absent.
const float* scale_ptr(const std::optional<Tensor>& t, const Tensor& q) {
  if (!t.has_value()) return nullptr;
  HSTU_CHECK_VALUE(t->device() == q.device(), "hstu_attention: inv_scale_tensor is on ",
                   t->device(), " but q is on ", q.device());
  HSTU_CHECK_TYPE(t->scalar_type() == at::kFloat,
                  "hstu_attention: inv_scale_tensor must be float32; got ", t->scalar_type());
  HSTU_CHECK_VALUE(t->numel() == 1, "hstu_attention: inv_scale_tensor must hold one value; got "
                   "shape ", shape_str(*t));
  return t->data_ptr<float>();
}

// The compacted grid's tile map (launch.h, compact_grid) for a training call, allocated only
// where the grid of hstu::kTileMapBlock-row blocks compacts (heavy-tailed lengths); else an
// undefined tensor.
Tensor tile_map_for(hstu::HstuParams& p, const Tensor& q) {
  constexpr int kBlock = hstu::kTileMapBlock;
  const int64_t full = int64_t(p.batch) * p.heads * ((int64_t(p.max_seqlen) + kBlock - 1) / kBlock);
  const int64_t compact = hstu::compact_grid_ctas(p, kBlock);
  if (!hstu::compact_grid_pays(compact, full)) return Tensor();
  Tensor map = at::empty({compact}, q.options().dtype(at::kInt));
  p.tile_map = map.data_ptr<int>();
  return map;
}

void launch(hstu::Direction dir, hstu::HstuParams& p) {
  const bool bias = p.pos_w != nullptr || p.time_w != nullptr;
  hstu::Launcher fn = nullptr;
  // The position-only backward where built; HSTU_ATTN_POSITION_BWD=0 takes the general
  // biased kernel instead (the two are compared in tests and benchmarks).
  const char* pos_bwd = std::getenv("HSTU_ATTN_POSITION_BWD");
  if (dir == hstu::Direction::kBwd && p.pos_w != nullptr && p.time_w == nullptr &&
      !(pos_bwd != nullptr && pos_bwd[0] == '0')) {
    fn = hstu::find_launcher(dir, p.dtype, p.head_dim, hstu::BiasKind::kPosition);
  }
  if (fn == nullptr) {
    const hstu::BiasKind kind = bias ? hstu::BiasKind::kAny : hstu::BiasKind::kNone;
    fn = hstu::find_launcher(dir, p.dtype, p.head_dim, kind);
  }
  const char* dt = p.dtype == hstu::DType::kBf16 ? "bf16" : "fp16";
  HSTU_CHECK(fn != nullptr, "hstu_attention: the ", dir == hstu::Direction::kFwd ? "fwd" : "bwd",
              bias ? " (relative bias)" : "", " kernel for ", dt, " head dim ", p.head_dim,
              " was not built (HSTU_KERNEL_DIMS filtered it out); rebuild with "
              "HSTU_KERNEL_DIMS unset or including '",
              dt, "_hdim", p.head_dim, "': pip install --no-build-isolation -e .");
  cudaError_t err = fn(p, at::cuda::getCurrentCUDAStream().stream());
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();
    cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
    HSTU_CHECK(false, "hstu_attention: the extension hstu._hstu_attention_C has no code for ",
                prop->name, " (SM ", prop->major, ".", prop->minor,
                "); rebuild it for this GPU: HSTU_CUDA_ARCH_LIST=\"8.0;", prop->major, ".",
                prop->minor, "\" pip install --no-build-isolation -e .");
  }
  if (err == cudaErrorInvalidConfiguration) {
    // the launchers refuse a kernel whose shared memory exceeds the budget they planned with
    // (the device's opt-in limit, or HSTU_ATTN_MAX_SMEM below it), and a grid past 2^31 CTAs
    (void)cudaGetLastError();
    const char* cap = std::getenv("HSTU_ATTN_MAX_SMEM");
    HSTU_CHECK(false, "hstu_attention: the ", dir == hstu::Direction::kFwd ? "fwd" : "bwd",
                bias ? " (relative bias)" : "", " kernel for ", dt, " head dim ", p.head_dim,
                " cannot be launched: its shared memory exceeds the per-block budget",
                cap ? " set by HSTU_ATTN_MAX_SMEM=" : " of this GPU", cap ? cap : "",
                " (raise or unset HSTU_ATTN_MAX_SMEM; every head dim fits 166912 bytes, the "
                "A100's limit), or its grid exceeds 2^31 blocks (", p.batch, " sequences x ",
                p.heads, " heads x query blocks of max_seqlen ", p.max_seqlen,
                "; split the batch)");
  }
  HSTU_CHECK(err == cudaSuccess, "hstu_attention: kernel launch failed: ",
              cudaGetErrorString(err));
}

Tensor fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seq_offsets,
                int64_t max_seqlen, const std::optional<Tensor>& num_contexts,
                const std::optional<Tensor>& num_targets, int64_t target_group_size,
                int64_t window_size, double alpha, double inv_scale, bool causal,
                const std::optional<Tensor>& timestamps, const std::optional<Tensor>& pos_weight,
                const std::optional<Tensor>& time_weight, const std::optional<Tensor>& time_edges,
                int64_t max_pos, const std::optional<Tensor>& last_query_time,
                const std::optional<Tensor>& inv_scale_tensor) {
  Checked c = check_inputs(q, k, v, seq_offsets, max_seqlen, num_contexts, num_targets,
                           target_group_size, window_size, alpha, inv_scale, causal);
  const BiasArgs bias{timestamps, pos_weight, time_weight, time_edges, max_pos, last_query_time};
  check_bias(bias, q, alpha, c.batch);
  c10::cuda::CUDAGuard guard(q.device());
  Tensor out = at::empty_like(v);
  if (q.size(0) == 0) return out;
  hstu::HstuParams p = make_params(q, c, max_seqlen, target_group_size, window_size, alpha,
                                   inv_scale, causal);
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.inv_scale_ptr = scale_ptr(inv_scale_tensor, q);
  set_bias_params(p, bias, alpha);
  const Tensor tile_map = tile_map_for(p, q);  // alive until the launch is queued
  launch(hstu::Direction::kFwd, p);
  return out;
}

// Queries against a cache (forward only; hstu.inference.kv_cache): q [Tq, H, D] jagged by
// q_offsets holds, per sequence b, the queries of its last Lq_b positions; k and v [Tk, H, D]
// hold sequence b's L_b rows from kv_offsets[b] (L_b = kv_lengths[b] when given, rows past it
// in the slot are never read; else kv_offsets[b + 1] - kv_offsets[b]). Masks and the bias are
// those of the whole sequence (num_contexts / num_targets / timestamps in the k/v layout);
// the output holds the query rows of `fwd` on the whole sequence. Outside CUDA graph capture
// every call validates the metadata on the host (GPU metadata is read back: a sync).
struct CachedChecked {
  Checked c;  // cu32: kv_offsets; ctx32 / tgt32
  Tensor q_cu32, len32;
  int64_t max_q_len = 0;
};

Tensor host_long(const Tensor& t, const char* name, int64_t n, const Tensor& q) {
  HSTU_CHECK_VALUE(t.dim() == 1 && t.numel() == n, "hstu_attention: ", name, " must be 1-D [",
                   n, "]; got shape ", shape_str(t));
  HSTU_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                  "hstu_attention: ", name, " must be int32 or int64; got ", t.scalar_type());
  HSTU_CHECK_VALUE(t.is_cpu() || t.device() == q.device(), "hstu_attention: ", name, " is on ",
                   t.device(), " but q is on ", q.device());
  return t.to(at::kCPU, at::kLong).contiguous();
}

// Offsets [n + 1] starting at 0, non-decreasing, ending at `total` (rows of `what`).
void check_offsets(const int64_t* o, int64_t n, int64_t total, const char* name,
                   const char* what) {
  HSTU_CHECK_VALUE(o[0] == 0, "hstu_attention: ", name, "[0] must be 0; got ", o[0]);
  for (int64_t b = 0; b < n; ++b) {
    HSTU_CHECK_VALUE(o[b + 1] >= o[b], "hstu_attention: ", name, " must be non-decreasing; ",
                     name, "[", b, "]=", o[b], " > ", name, "[", b + 1, "]=", o[b + 1]);
  }
  HSTU_CHECK_VALUE(o[n] == total, "hstu_attention: ", name, "[-1]=", o[n], " != the ", total,
                   " rows of ", what);
  HSTU_CHECK_VALUE(total <= std::numeric_limits<int32_t>::max(), "hstu_attention: ", total,
                   " rows of ", what, " exceed the int32 range");
}

CachedChecked check_cached_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& q_offsets, const Tensor& kv_offsets,
                                  const std::optional<Tensor>& kv_lengths,
                                  const std::optional<Tensor>& num_contexts,
                                  const std::optional<Tensor>& num_targets,
                                  int64_t target_group_size, int64_t window_size, double alpha,
                                  double inv_scale, int64_t max_q_seqlen, int64_t max_seqlen) {
  check_qkv(q, "q", q);
  check_qkv(k, "k", q);
  check_qkv(v, "v", q);
  HSTU_CHECK_VALUE(k.sizes() == v.sizes(), "hstu_attention: k and v must have the same shape; got k",
                   shape_str(k), " v", shape_str(v));
  HSTU_CHECK_VALUE(k.size(1) == q.size(1) && k.size(2) == q.size(2),
                   "hstu_attention: q and k/v must share [H, D]; got q", shape_str(q), " k",
                   shape_str(k));
  // the scalar checks of the training op (q stands in for k/v: same [H, D] checked above)
  check_tensors_and_scalars(q, q, q, 0, num_contexts, num_targets, target_group_size, window_size,
                            alpha, inv_scale, true);
  HSTU_CHECK_VALUE(kv_offsets.dim() == 1 && kv_offsets.numel() >= 1,
                   "hstu_attention: kv_offsets must be 1-D [B+1]; got shape ",
                   shape_str(kv_offsets));
  const int64_t batch = kv_offsets.numel() - 1;
  HSTU_CHECK_VALUE(batch <= 65535, "hstu_attention: batch size ", batch, " exceeds 65535");
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    // Under CUDA graph capture: GPU metadata taken as given (no value can be read without a
    // sync); the caller validated it on the host and passes the maxima that size the grid.
    HSTU_CHECK_VALUE(max_q_seqlen > 0 && max_seqlen >= max_q_seqlen &&
                         max_seqlen <= std::numeric_limits<int32_t>::max(),
                     "hstu_attention: under CUDA graph capture fwd_cached needs max_q_seqlen > 0 "
                     "and max_seqlen >= max_q_seqlen; got ", max_q_seqlen, " and ", max_seqlen);
    auto on_gpu = [&](const Tensor& t, const char* name, int64_t n) {
      HSTU_CHECK_VALUE(t.device() == q.device() && t.dim() == 1 && t.numel() == n,
                       "hstu_attention: under CUDA graph capture ", name, " must be a [", n,
                       "] tensor on q's device ", q.device(), "; got ", shape_str(t), " on ",
                       t.device());
      HSTU_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                      "hstu_attention: ", name, " must be int32 or int64; got ", t.scalar_type());
      return t.to(at::kInt).contiguous();
    };
    CachedChecked r;
    r.c.batch = int(batch);
    r.c.max_len = max_seqlen;
    r.c.cu32 = on_gpu(kv_offsets, "kv_offsets", batch + 1);
    r.q_cu32 = on_gpu(q_offsets, "q_offsets", batch + 1);
    if (kv_lengths.has_value()) r.len32 = on_gpu(*kv_lengths, "kv_lengths", batch);
    if (num_contexts.has_value()) r.c.ctx32 = on_gpu(*num_contexts, "num_contexts", batch);
    if (num_targets.has_value()) r.c.tgt32 = on_gpu(*num_targets, "num_targets", batch);
    r.max_q_len = max_q_seqlen;
    return r;
  }
  Tensor qo = host_long(q_offsets, "q_offsets", batch + 1, q);
  Tensor ko = host_long(kv_offsets, "kv_offsets", batch + 1, q);
  const int64_t* qp = qo.data_ptr<int64_t>();
  const int64_t* kp = ko.data_ptr<int64_t>();
  check_offsets(qp, batch, q.size(0), "q_offsets", "q");
  check_offsets(kp, batch, k.size(0), "kv_offsets", "k and v");
  std::vector<int64_t> len(batch);
  Tensor lens;
  if (kv_lengths.has_value()) {
    lens = host_long(*kv_lengths, "kv_lengths", batch, q);
    const int64_t* lp = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      HSTU_CHECK_VALUE(lp[b] >= 0 && lp[b] <= kp[b + 1] - kp[b], "hstu_attention: kv_lengths[",
                       b, "]=", lp[b], " must be in [0, kv_offsets[", b + 1, "] - kv_offsets[",
                       b, "]=", kp[b + 1] - kp[b], "]");
      len[b] = lp[b];
    }
  } else {
    for (int64_t b = 0; b < batch; ++b) len[b] = kp[b + 1] - kp[b];
  }
  CachedChecked r;
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t lq = qp[b + 1] - qp[b];
    HSTU_CHECK_VALUE(lq <= len[b], "hstu_attention: sequence ", b, " has ", lq,
                     " queries but only ", len[b], " keys (the queries are its last positions)");
    max_len = std::max(max_len, len[b]);
    r.max_q_len = std::max(r.max_q_len, lq);
  }
  auto counts = [&](const std::optional<Tensor>& t, const char* name) -> std::vector<int64_t> {
    std::vector<int64_t> out(batch, 0);
    if (!t.has_value()) return out;
    Tensor h = host_long(*t, name, batch, q);
    const int64_t* p = h.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      HSTU_CHECK_VALUE(p[b] >= 0 && p[b] <= len[b], "hstu_attention: ", name, "[", b, "]=", p[b],
                       " must be in [0, length=", len[b], "]");
      out[b] = p[b];
    }
    return out;
  };
  const std::vector<int64_t> ctx = counts(num_contexts, "num_contexts");
  const std::vector<int64_t> tgt = counts(num_targets, "num_targets");
  for (int64_t b = 0; b < batch; ++b) {
    HSTU_CHECK_VALUE(ctx[b] + tgt[b] <= len[b], "hstu_attention: num_contexts[", b, "]=", ctx[b],
                     " + num_targets[", b, "]=", tgt[b], " exceeds the sequence length ", len[b]);
  }
  r.c.batch = int(batch);
  r.c.max_len = max_len;
  r.c.cu32 = to_device_int32(kv_offsets, kp, batch + 1, q);
  if (num_contexts.has_value()) r.c.ctx32 = to_device_int32(*num_contexts, ctx.data(), batch, q);
  if (num_targets.has_value()) r.c.tgt32 = to_device_int32(*num_targets, tgt.data(), batch, q);
  r.q_cu32 = to_device_int32(q_offsets, qp, batch + 1, q);
  if (kv_lengths.has_value()) r.len32 = to_device_int32(*kv_lengths, len.data(), batch, q);
  return r;
}

// Key splits of a cached forward (num_splits=0): one query block per (sequence, head) and few
// sequences leave most SMs idle (e.g. one user's 100 candidates x 4 heads: 8 CTAs), while each CTA
// walks every key block of a long history. Splits fill about one wave of SMs, each CTA keeping
// at least 2 key blocks of 64 (the tile sizes vary by head dim; 64 is the smallest of them).
constexpr int64_t kMaxKeySplits = 64;

int key_splits(int64_t max_q_len, int64_t max_len, int64_t batch, int64_t heads) {
  const int64_t ctas = (max_q_len + 63) / 64 * batch * heads;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (ctas <= 0 || ctas >= sms) return 1;
  const int64_t by_sms = (sms + ctas - 1) / ctas;
  const int64_t by_keys = (max_len + 63) / 64 / 2;
  return int(std::max<int64_t>(1, std::min({by_sms, by_keys, kMaxKeySplits})));
}

Tensor fwd_cached_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_offsets,
                       const Tensor& kv_offsets, const std::optional<Tensor>& kv_lengths,
                       const std::optional<Tensor>& num_contexts,
                       const std::optional<Tensor>& num_targets, int64_t target_group_size,
                       int64_t window_size, double alpha, double inv_scale,
                       const std::optional<Tensor>& timestamps,
                       const std::optional<Tensor>& pos_weight,
                       const std::optional<Tensor>& time_weight,
                       const std::optional<Tensor>& time_edges, int64_t max_pos,
                       const std::optional<Tensor>& last_query_time, int64_t max_q_seqlen,
                       int64_t max_seqlen, int64_t num_splits) {
  HSTU_CHECK_VALUE(num_splits >= 0 && num_splits <= kMaxKeySplits, "hstu_attention: num_splits=",
                   num_splits, " must be in [0, ", kMaxKeySplits, "] (0: chosen per call, 1: none)");
  CachedChecked cc = check_cached_inputs(q, k, v, q_offsets, kv_offsets, kv_lengths, num_contexts,
                                         num_targets, target_group_size, window_size, alpha,
                                         inv_scale, max_q_seqlen, max_seqlen);
  const BiasArgs bias{timestamps, pos_weight, time_weight, time_edges, max_pos, last_query_time};
  // the bias's per-token tensors follow the k/v layout
  check_bias(bias, k, alpha, cc.c.batch);
  c10::cuda::CUDAGuard guard(q.device());
  Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  hstu::HstuParams p = make_params(q, cc.c, cc.c.max_len, target_group_size, window_size, alpha,
                                   inv_scale, true);
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.total = int(k.size(0));
  p.q_cu_seqlens = cc.q_cu32.data_ptr<int>();
  p.seq_lens = cc.len32.defined() ? cc.len32.data_ptr<int>() : nullptr;
  p.max_q_seqlen = int(cc.max_q_len);
  set_bias_params(p, bias, alpha);
  p.num_splits = num_splits == 0 ? key_splits(cc.max_q_len, cc.c.max_len, cc.c.batch, q.size(1))
                                 : int(num_splits);
  if (p.num_splits == 1) {
    launch(hstu::Direction::kFwd, p);
    return out;
  }
  // partial outputs of the key splits add into a zeroed fp32 buffer, converted once
  Tensor acc = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  p.o_accum = acc.data_ptr<float>();
  launch(hstu::Direction::kFwd, p);
  out.copy_(acc);
  return out;
}

Tensor fwd_cached_meta(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_offsets,
                       const Tensor& kv_offsets, const std::optional<Tensor>& kv_lengths,
                       const std::optional<Tensor>& num_contexts,
                       const std::optional<Tensor>& num_targets, int64_t target_group_size,
                       int64_t window_size, double alpha, double inv_scale,
                       const std::optional<Tensor>& timestamps,
                       const std::optional<Tensor>& pos_weight,
                       const std::optional<Tensor>& time_weight,
                       const std::optional<Tensor>& time_edges, int64_t max_pos,
                       const std::optional<Tensor>& last_query_time, int64_t max_q_seqlen,
                       int64_t max_seqlen, int64_t num_splits) {
  return at::empty_like(q);
}

// HSTU_ATTN_DQ_CONVERT=bwd: the backward kernel converts dQ itself (the last key block to reach a
// query block converts it; per-query-block arrival counters) instead of the separate convert
// kernel (unset or any other value). On the H100 it is slower (forward+backward: long_d128 215 vs
// 250 TF/s, long_d256 206 vs 228), so it is opt-in.
bool dq_convert_in_bwd_requested() {
  const char* e = std::getenv("HSTU_ATTN_DQ_CONVERT");
  return e != nullptr && std::strcmp(e, "bwd") == 0;
}

// Zeroed fp32 gradient of an optional bias weight, or an empty tensor.
Tensor weight_grad(const std::optional<Tensor>& w, const Tensor& q) {
  return w.has_value() ? at::zeros_like(*w) : at::empty({0}, q.options().dtype(at::kFloat));
}

using BwdResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

BwdResult bwd_cuda(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& seq_offsets, int64_t max_seqlen, const std::optional<Tensor>& num_contexts,
    const std::optional<Tensor>& num_targets, int64_t target_group_size, int64_t window_size,
    double alpha, double inv_scale, bool causal, bool deterministic,
    const std::optional<Tensor>& timestamps, const std::optional<Tensor>& pos_weight,
    const std::optional<Tensor>& time_weight, const std::optional<Tensor>& time_edges,
    int64_t max_pos, const std::optional<Tensor>& last_query_time,
    const std::optional<Tensor>& inv_scale_tensor, bool dq_fp32) {
  Checked c = check_inputs(q, k, v, seq_offsets, max_seqlen, num_contexts, num_targets,
                           target_group_size, window_size, alpha, inv_scale, causal);
  const BiasArgs bias{timestamps, pos_weight, time_weight, time_edges, max_pos, last_query_time};
  check_bias(bias, q, alpha, c.batch);
  check_qkv(dout, "dout", q);
  HSTU_CHECK_VALUE(dout.sizes() == v.sizes(), "hstu_attention: dout must have the output's shape ",
              shape_str(v), "; got ", shape_str(dout));
  c10::cuda::CUDAGuard guard(q.device());
  // Head-major [H, T, D]: the kernel's dQ reductions then use compile-time row offsets. With
  // dq_fp32 it is the returned dq itself (no conversion): the fused layer's SiLU backward reads it.
  Tensor dq_accum = at::zeros({q.size(1), q.size(0), q.size(2)}, q.options().dtype(at::kFloat));
  Tensor dq = dq_fp32 ? dq_accum : at::empty_like(q);
  Tensor dk = at::empty_like(k);
  Tensor dv = at::empty_like(v);
  Tensor dpos = weight_grad(pos_weight, q);
  Tensor dtime = weight_grad(time_weight, q);
  if (q.size(0) == 0) return {dq, dk, dv, dpos, dtime};
  hstu::HstuParams p = make_params(q, c, max_seqlen, target_group_size, window_size, alpha,
                                   inv_scale, causal);
  Tensor sem;
  if (deterministic || (!dq_fp32 && dq_convert_in_bwd_requested())) {
    // One int32 per (head, sequence, query block): the deterministic mode's semaphores, or the
    // arrival counters with which the backward kernel converts dq_accum to dq itself.
    const int64_t m_blocks = (int64_t(p.max_seqlen) + kMinBlockM - 1) / kMinBlockM;
    sem = at::zeros({int64_t(p.heads) * p.batch * std::max<int64_t>(m_blocks, 1)},
                    q.options().dtype(at::kInt));
    (deterministic ? p.dq_semaphore : p.dq_counter) = sem.data_ptr<int>();
  }
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.dout = dout.data_ptr();
  p.dq = dq_fp32 ? nullptr : dq.data_ptr();  // nullptr: dQ stays in dq_accum
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_accum = dq_accum.data_ptr<float>();
  p.deterministic = deterministic;
  p.inv_scale_ptr = scale_ptr(inv_scale_tensor, q);
  set_bias_params(p, bias, alpha);
  if (pos_weight.has_value()) p.dpos_w = dpos.data_ptr<float>();
  if (time_weight.has_value()) p.dtime_w = dtime.data_ptr<float>();
  const Tensor tile_map = tile_map_for(p, q);  // alive until the launch is queued
  launch(hstu::Direction::kBwd, p);
  return {dq, dk, dv, dpos, dtime};
}

Tensor fwd_meta(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seq_offsets,
                int64_t max_seqlen, const std::optional<Tensor>& num_contexts,
                const std::optional<Tensor>& num_targets, int64_t target_group_size,
                int64_t window_size, double alpha, double inv_scale, bool causal,
                const std::optional<Tensor>& timestamps, const std::optional<Tensor>& pos_weight,
                const std::optional<Tensor>& time_weight, const std::optional<Tensor>& time_edges,
                int64_t max_pos, const std::optional<Tensor>& last_query_time,
                const std::optional<Tensor>& inv_scale_tensor) {
  HSTU_CHECK(v.size(2) == q.size(2), "hstu_attention: the CUDA kernel requires Dqk == Dv");
  return at::empty_like(v);
}

BwdResult bwd_meta(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& seq_offsets, int64_t max_seqlen, const std::optional<Tensor>& num_contexts,
    const std::optional<Tensor>& num_targets, int64_t target_group_size, int64_t window_size,
    double alpha, double inv_scale, bool causal, bool deterministic,
    const std::optional<Tensor>& timestamps, const std::optional<Tensor>& pos_weight,
    const std::optional<Tensor>& time_weight, const std::optional<Tensor>& time_edges,
    int64_t max_pos, const std::optional<Tensor>& last_query_time,
    const std::optional<Tensor>& inv_scale_tensor, bool dq_fp32) {
  auto grad = [&](const std::optional<Tensor>& w) {
    return w.has_value() ? at::empty_like(*w) : at::empty({0}, q.options().dtype(at::kFloat));
  };
  Tensor dq = dq_fp32 ? at::empty_symint({q.sym_size(1), q.sym_size(0), q.sym_size(2)},
                                         q.options().dtype(at::kFloat))
                      : at::empty_like(q);
  return {dq, at::empty_like(k), at::empty_like(v), grad(pos_weight), grad(time_weight)};
}

}  // namespace

TORCH_LIBRARY(hstu_attention, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, int max_seqlen, "
      "Tensor? num_contexts, Tensor? num_targets, int target_group_size, int window_size, "
      "float alpha, float inv_scale, bool causal, Tensor? timestamps=None, "
      "Tensor? pos_weight=None, Tensor? time_weight=None, Tensor? time_edges=None, "
      "int max_pos=0, Tensor? last_query_time=None, Tensor? inv_scale_tensor=None) -> Tensor");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, int max_seqlen, "
      "Tensor? num_contexts, Tensor? num_targets, int target_group_size, int window_size, "
      "float alpha, float inv_scale, bool causal, bool deterministic, Tensor? timestamps=None, "
      "Tensor? pos_weight=None, Tensor? time_weight=None, Tensor? time_edges=None, "
      "int max_pos=0, Tensor? last_query_time=None, Tensor? inv_scale_tensor=None, "
      "bool dq_fp32=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fwd_cached(Tensor q, Tensor k, Tensor v, Tensor q_offsets, Tensor kv_offsets, "
      "Tensor? kv_lengths, Tensor? num_contexts, Tensor? num_targets, int target_group_size, "
      "int window_size, float alpha, float inv_scale, Tensor? timestamps=None, "
      "Tensor? pos_weight=None, Tensor? time_weight=None, Tensor? time_edges=None, "
      "int max_pos=0, Tensor? last_query_time=None, int max_q_seqlen=0, int max_seqlen=0, "
      "int num_splits=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(hstu_attention, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("fwd_cached", &fwd_cached_cuda);
}

TORCH_LIBRARY_IMPL(hstu_attention, Meta, m) {
  m.impl("fwd", &fwd_meta);
  m.impl("bwd", &bwd_meta);
  m.impl("fwd_cached", &fwd_cached_meta);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "HSTU attention CUDA kernels; the ops live in torch.ops.hstu_attention";
  // Whether the build carries the SM90 (wgmma) kernels, used on 9.0 devices (launch.h).
  m.def("has_sm90_kernels", [] {
#if defined(HSTU_SM90A)
    return true;
#else
    return false;
#endif
  });
}
