// Torch face of the dynamic-embedding kernels: input checks and op registration
// (namespace hstu_dynemb). The Python side (hstu/embeddings/cuda_table.py) owns the tensors of a
// table and calls these ops; hstu/embeddings/reference_table.py is the pure-PyTorch twin.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#include "../common/error_message.h"
#include "launch.h"

namespace {

using at::Tensor;

// Input checks throw c10::Error with messages built without iostreams
// (kernels/common/error_message.h says why).
#define DYNEMB_CHECK(cond, ...) HSTU_RAISE_IF_NOT(Error, cond, __VA_ARGS__)

void check_i64(const Tensor& t, const char* name) {
  DYNEMB_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
  DYNEMB_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  DYNEMB_CHECK(t.is_contiguous(), name, " must be contiguous");
  DYNEMB_CHECK(t.dim() == 1, name, " must be 1-D, got ", t.dim(), "-D");
}

void check_table(const Tensor& keys) {
  check_i64(keys, "keys");
  DYNEMB_CHECK(keys.numel() > 0 && keys.numel() % dynemb::kBucket == 0,
              "keys: the slot count must be a positive multiple of ", dynemb::kBucket, ", got ",
              keys.numel());
}

// rows_optional: values may have 0 rows (a table of keys only, the slot directory of a hybrid
// table); otherwise one row per slot.
void check_values(const Tensor& values, const Tensor& keys, int64_t dim,
                  bool rows_optional = false) {
  DYNEMB_CHECK(values.is_cuda() && values.scalar_type() == at::kFloat && values.is_contiguous() &&
                  values.dim() == 2,
              "values must be a contiguous 2-D float32 CUDA tensor");
  DYNEMB_CHECK(values.size(0) == keys.numel() || (rows_optional && values.size(0) == 0),
              "values has ", values.size(0), " rows for ", keys.numel(), " slots");
  DYNEMB_CHECK(dim > 0 && dim <= values.size(1), "dim=", dim, " out of range for width ",
              values.size(1));
  DYNEMB_CHECK(values.size(1) % 4 == 0, "values width must be a multiple of 4, got ",
              values.size(1));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

// The training step as a one-element int64 tensor on the table's device, read by the kernel
// instead of `step` (a CUDA graph then replays the step of the moment), or null.
const int64_t* step_pointer(const std::optional<Tensor>& step_tensor, const Tensor& keys) {
  if (!step_tensor) return nullptr;
  const Tensor& t = *step_tensor;
  DYNEMB_CHECK(t.is_cuda() && t.device() == keys.device(), "step_tensor must be on ",
              keys.device(), ", got ", t.device());
  DYNEMB_CHECK(t.scalar_type() == at::kLong && t.numel() == 1,
              "step_tensor must hold one int64, got ", t.numel(), " of ", t.scalar_type());
  return t.data_ptr<int64_t>();
}

Tensor find(const Tensor& keys, const Tensor& query) {
  check_table(keys);
  check_i64(query, "query");
  const c10::cuda::CUDAGuard guard(keys.device());
  auto slots = at::empty_like(query);
  dynemb::launch_find(keys.data_ptr<int64_t>(), keys.numel() / dynemb::kBucket,
                      query.data_ptr<int64_t>(), query.numel(), slots.data_ptr<int64_t>(),
                      nullptr, nullptr, nullptr, 0, nullptr, 0, stream());
  return slots;
}

Tensor find_touch(const Tensor& keys, const Tensor& scores, const Tensor& touched, const Tensor& query,
                  const std::optional<Tensor>& score_vals, int64_t step, bool accumulate,
                  const std::optional<Tensor>& step_tensor) {
  check_table(keys);
  check_i64(scores, "scores");
  check_i64(touched, "touched");
  check_i64(query, "query");
  DYNEMB_CHECK(scores.numel() == keys.numel() && touched.numel() == keys.numel(),
              "scores/touched must have one entry per slot");
  if (score_vals) {
    check_i64(*score_vals, "score_vals");
    DYNEMB_CHECK(score_vals->numel() == query.numel(), "score_vals needs one value per query");
  }
  const c10::cuda::CUDAGuard guard(keys.device());
  auto slots = at::empty_like(query);
  dynemb::launch_find(keys.data_ptr<int64_t>(), keys.numel() / dynemb::kBucket,
                      query.data_ptr<int64_t>(), query.numel(), slots.data_ptr<int64_t>(),
                      scores.data_ptr<int64_t>(), touched.data_ptr<int64_t>(),
                      score_vals ? score_vals->data_ptr<int64_t>() : nullptr, step,
                      step_pointer(step_tensor, keys), accumulate ? 2 : 1, stream());
  return slots;
}

dynemb::InitParams init_params(int64_t seed, int64_t init_kind, double p0, double p1, double p2,
                               double p3) {
  DYNEMB_CHECK(init_kind >= 0 && init_kind <= 3, "init_kind must be 0..3, got ", init_kind);
  dynemb::InitParams init;
  init.kind = static_cast<int>(init_kind);
  init.seed_mix = dynemb::mix64(static_cast<uint64_t>(seed) + dynemb::kSeedSalt);
  init.p0 = p0;
  init.p1 = p1;
  init.p2 = p2;
  init.p3 = p3;
  init.cdf_a = 0.5 * (1.0 + std::erf(p2 / std::sqrt(2.0)));
  init.cdf_b = 0.5 * (1.0 + std::erf(p3 / std::sqrt(2.0)));
  return init;
}

std::tuple<Tensor, Tensor> insert(const Tensor& keys, const Tensor& scores, const Tensor& touched, const Tensor& values,
                                  const Tensor& new_keys, const Tensor& seg_offsets,
                                  const Tensor& seg_buckets, const Tensor& score_vals,
                                  int64_t step, int64_t dim, int64_t seed, int64_t init_kind,
                                  double p0, double p1, double p2, double p3,
                                  const std::optional<Tensor>& step_tensor) {
  check_table(keys);
  check_i64(scores, "scores");
  check_i64(touched, "touched");
  check_values(values, keys, dim, /*rows_optional=*/true);
  check_i64(new_keys, "new_keys");
  check_i64(seg_offsets, "seg_offsets");
  check_i64(seg_buckets, "seg_buckets");
  check_i64(score_vals, "score_vals");
  DYNEMB_CHECK(seg_offsets.numel() == seg_buckets.numel() + 1,
              "seg_offsets needs one more entry than seg_buckets");
  DYNEMB_CHECK(score_vals.numel() == new_keys.numel(), "score_vals needs one value per new key");
  const c10::cuda::CUDAGuard guard(keys.device());
  const dynemb::InitParams init = init_params(seed, init_kind, p0, p1, p2, p3);
  auto out_slots = at::empty_like(new_keys);
  auto n_evicted = at::zeros({}, keys.options());
  dynemb::launch_insert(keys.data_ptr<int64_t>(), scores.data_ptr<int64_t>(),
                        touched.data_ptr<int64_t>(),
                        values.size(0) ? values.data_ptr<float>() : nullptr, values.size(1),
                        static_cast<int>(dim), new_keys.data_ptr<int64_t>(),
                        seg_offsets.data_ptr<int64_t>(), seg_buckets.data_ptr<int64_t>(),
                        seg_buckets.numel(), score_vals.data_ptr<int64_t>(), step,
                        step_pointer(step_tensor, keys), init,
                        out_slots.data_ptr<int64_t>(), n_evicted.data_ptr<int64_t>(), stream());
  return {out_slots, n_evicted};
}

Tensor gather(const Tensor& values, int64_t dim, const Tensor& slots, const Tensor& inverse) {
  DYNEMB_CHECK(values.is_cuda() && values.scalar_type() == at::kFloat && values.is_contiguous() &&
                  values.dim() == 2 && values.size(1) % 4 == 0,
              "values must be a contiguous [slots, 4k] float32 CUDA tensor");
  DYNEMB_CHECK(dim > 0 && dim <= values.size(1), "dim out of range");
  check_i64(slots, "slots");
  check_i64(inverse, "inverse");
  const c10::cuda::CUDAGuard guard(values.device());
  auto out = at::empty({inverse.numel(), dim}, values.options());
  dynemb::launch_gather(values.data_ptr<float>(), values.size(1), static_cast<int>(dim),
                        slots.data_ptr<int64_t>(), inverse.data_ptr<int64_t>(), inverse.numel(),
                        out.data_ptr<float>(), stream());
  return out;
}

void update(const Tensor& values, int64_t dim, const Tensor& keys, const Tensor& uniq,
            const Tensor& slots, const Tensor& perm, const Tensor& offsets, const Tensor& grad,
            int64_t opt, double lr, double beta1, double beta2, double eps, double weight_decay) {
  check_table(keys);
  check_values(values, keys, dim);
  check_i64(uniq, "uniq");
  check_i64(slots, "slots");
  check_i64(perm, "perm");
  check_i64(offsets, "offsets");
  DYNEMB_CHECK(grad.is_cuda() && grad.scalar_type() == at::kFloat && grad.is_contiguous() &&
                  grad.dim() == 2 && grad.size(1) == dim,
              "grad must be a contiguous [n, ", dim, "] float32 CUDA tensor");
  DYNEMB_CHECK(perm.numel() == grad.size(0), "perm needs one entry per gradient row");
  DYNEMB_CHECK(slots.numel() == uniq.numel() && offsets.numel() == uniq.numel() + 1,
              "slots/offsets do not match uniq");
  DYNEMB_CHECK(opt >= 0 && opt <= 3, "optimizer code must be 0..3, got ", opt);
  const int64_t need = opt == 0 ? dim : opt == 1 ? 3 * dim + 1 : opt == 2 ? 2 * dim : dim + 1;
  DYNEMB_CHECK(values.size(1) >= need, "values width ", values.size(1), " too small for optimizer ",
              opt);
  const c10::cuda::CUDAGuard guard(values.device());
  dynemb::OptParams p{static_cast<int>(opt), static_cast<float>(lr), static_cast<float>(beta1),
                      static_cast<float>(beta2), static_cast<float>(eps),
                      static_cast<float>(weight_decay)};
  dynemb::launch_update(values.data_ptr<float>(), values.size(1), static_cast<int>(dim),
                        keys.data_ptr<int64_t>(), uniq.data_ptr<int64_t>(),
                        slots.data_ptr<int64_t>(), perm.data_ptr<int64_t>(),
                        offsets.data_ptr<int64_t>(), grad.data_ptr<float>(), uniq.numel(), p,
                        stream());
}

void copy_rows(const Tensor& dst, const Tensor& dst_idx, const Tensor& src,
               const Tensor& src_idx) {
  for (const Tensor* t : {&dst, &src}) {
    DYNEMB_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->dim() == 2 && t->size(1) % 4 == 0,
                "copy_rows: dst and src must be contiguous [rows, 4k] float32 tensors on the GPU "
                "(or mapped for it), got ", t->sizes(), " ", t->scalar_type());
  }
  DYNEMB_CHECK(dst.size(1) == src.size(1), "copy_rows: dst rows have ", dst.size(1),
              " floats, src rows ", src.size(1));
  check_i64(dst_idx, "dst_idx");
  check_i64(src_idx, "src_idx");
  DYNEMB_CHECK(dst_idx.numel() == src_idx.numel(), "copy_rows: ", dst_idx.numel(),
              " destination indices for ", src_idx.numel(), " source indices");
  DYNEMB_CHECK(reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0,
              "copy_rows: dst and src must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(dst_idx.device());
  dynemb::launch_copy_rows(dst.data_ptr<float>(), dst.size(0), src.data_ptr<float>(), src.size(0),
                           dst.size(1), dst_idx.data_ptr<int64_t>(), src_idx.data_ptr<int64_t>(),
                           dst_idx.numel(), stream());
}

Tensor place_rows(const Tensor& cache, const Tensor& row_keys, const Tensor& cache_slot,
                  const Tensor& slot_row, const Tensor& free_rows, const Tensor& n_free,
                  const Tensor& host, const Tensor& slots, const Tensor& miss, const Tensor& uniq,
                  int64_t dim, int64_t seed, int64_t init_kind, double p0, double p1, double p2,
                  double p3, const Tensor& counters) {
  for (const Tensor* t : {&cache, &host}) {
    DYNEMB_CHECK(t->is_cuda() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->dim() == 2 && t->size(1) % 4 == 0,
                "place_rows: the cache and the host tier must be contiguous [rows, 4k] float32 "
                "tensors on (or mapped for) the GPU");
  }
  DYNEMB_CHECK(cache.size(1) == host.size(1), "place_rows: cache and host rows differ in width");
  DYNEMB_CHECK(dim > 0 && dim <= cache.size(1), "place_rows: dim out of range");
  const int64_t rows = cache.size(0);
  check_i64(row_keys, "row_keys");
  check_i64(cache_slot, "cache_slot");
  check_i64(free_rows, "free_rows");
  DYNEMB_CHECK(row_keys.numel() > rows && cache_slot.numel() > rows && free_rows.numel() > rows,
              "place_rows: row_keys, cache_slot and free_rows need one entry per cache row "
              "and a spare");
  DYNEMB_CHECK(slot_row.is_cuda() && slot_row.scalar_type() == at::kInt &&
                  slot_row.is_contiguous() && slot_row.numel() > host.size(0),
              "place_rows: slot_row must be int32 with one entry per slot and a spare");
  DYNEMB_CHECK(n_free.is_cuda() && n_free.scalar_type() == at::kLong && n_free.numel() == 1,
              "place_rows: n_free must be one int64 on the GPU");
  check_i64(slots, "slots");
  check_i64(uniq, "uniq");
  DYNEMB_CHECK(miss.is_cuda() && miss.scalar_type() == at::kBool && miss.is_contiguous() &&
                  miss.numel() == slots.numel() && uniq.numel() == slots.numel(),
              "place_rows: slots, miss (bool) and uniq need one entry per unique id");
  check_i64(counters, "counters");
  DYNEMB_CHECK(counters.numel() == 4, "place_rows: counters must have 4 entries");
  const c10::cuda::CUDAGuard guard(cache.device());
  auto out = at::empty_like(slots);
  dynemb::launch_place_rows(
      cache.data_ptr<float>(), cache.size(1), static_cast<int>(dim), row_keys.data_ptr<int64_t>(),
      cache_slot.data_ptr<int64_t>(), slot_row.data_ptr<int>(), free_rows.data_ptr<int64_t>(),
      n_free.data_ptr<int64_t>(), host.data_ptr<float>(), slots.data_ptr<int64_t>(),
      miss.data_ptr<bool>(), uniq.data_ptr<int64_t>(), slots.numel(),
      init_params(seed, init_kind, p0, p1, p2, p3), out.data_ptr<int64_t>(),
      counters.data_ptr<int64_t>(), stream());
  return out;
}

Tensor erase(const Tensor& keys, const Tensor& scores, const Tensor& touched, const Tensor& query) {
  check_table(keys);
  check_i64(scores, "scores");
  check_i64(touched, "touched");
  check_i64(query, "query");
  const c10::cuda::CUDAGuard guard(keys.device());
  auto n = at::zeros({}, keys.options());
  dynemb::launch_erase(keys.data_ptr<int64_t>(), scores.data_ptr<int64_t>(),
                       touched.data_ptr<int64_t>(), keys.numel() / dynemb::kBucket,
                       query.data_ptr<int64_t>(), query.numel(), n.data_ptr<int64_t>(), stream());
  return n;
}

Tensor size(const Tensor& keys) {
  check_table(keys);
  const c10::cuda::CUDAGuard guard(keys.device());
  auto n = at::zeros({}, keys.options());
  dynemb::launch_size(keys.data_ptr<int64_t>(), keys.numel(), n.data_ptr<int64_t>(), stream());
  return n;
}

Tensor export_slots(const Tensor& keys) {
  check_table(keys);
  const c10::cuda::CUDAGuard guard(keys.device());
  const int64_t n = size(keys).item<int64_t>();
  auto out = at::empty({n}, keys.options());
  auto count = at::zeros({}, keys.options());
  if (n > 0) {
    dynemb::launch_export(keys.data_ptr<int64_t>(), keys.numel(), out.data_ptr<int64_t>(),
                          count.data_ptr<int64_t>(), stream());
  }
  return out;
}

Tensor bucket_of(const Tensor& query, int64_t num_buckets) {
  check_i64(query, "query");
  DYNEMB_CHECK(num_buckets > 0, "num_buckets must be > 0");
  const c10::cuda::CUDAGuard guard(query.device());
  auto out = at::empty_like(query);
  dynemb::launch_bucket_of(query.data_ptr<int64_t>(), query.numel(), num_buckets,
                           out.data_ptr<int64_t>(), stream());
  return out;
}

}  // namespace

TORCH_LIBRARY(hstu_dynemb, m) {
  m.def("find(Tensor keys, Tensor query) -> Tensor");
  m.def(
      "find_touch(Tensor keys, Tensor(a!) scores, Tensor(b!) touched, Tensor query, "
      "Tensor? score_vals, int step, bool accumulate, Tensor? step_tensor=None) -> Tensor");
  m.def(
      "insert(Tensor(a!) keys, Tensor(b!) scores, Tensor(c!) touched, Tensor(d!) values, "
      "Tensor new_keys, Tensor seg_offsets, Tensor seg_buckets, Tensor score_vals, int step, "
      "int dim, int seed, int init_kind, float p0, float p1, float p2, float p3, "
      "Tensor? step_tensor=None) -> (Tensor, Tensor)");
  m.def("gather(Tensor values, int dim, Tensor slots, Tensor inverse) -> Tensor");
  m.def(
      "update(Tensor(a!) values, int dim, Tensor keys, Tensor uniq, Tensor slots, Tensor perm, "
      "Tensor offsets, Tensor grad, int opt, float lr, float beta1, float beta2, float eps, "
      "float weight_decay) -> ()");
  m.def("copy_rows(Tensor(a!) dst, Tensor dst_idx, Tensor src, Tensor src_idx) -> ()");
  m.def(
      "place_rows(Tensor(a!) cache, Tensor(b!) row_keys, Tensor(c!) cache_slot, "
      "Tensor(d!) slot_row, Tensor free_rows, Tensor(e!) n_free, Tensor host, Tensor slots, "
      "Tensor miss, Tensor uniq, int dim, int seed, int init_kind, float p0, float p1, "
      "float p2, float p3, Tensor(f!) counters) -> Tensor");
  m.def("erase(Tensor(a!) keys, Tensor(b!) scores, Tensor(c!) touched, Tensor query) -> Tensor");
  m.def("size(Tensor keys) -> Tensor");
  m.def("export(Tensor keys) -> Tensor");
  m.def("bucket_of(Tensor query, int num_buckets) -> Tensor");
}

TORCH_LIBRARY_IMPL(hstu_dynemb, CUDA, m) {
  m.impl("find", &find);
  m.impl("find_touch", &find_touch);
  m.impl("insert", &insert);
  m.impl("gather", &gather);
  m.impl("update", &update);
  m.impl("copy_rows", &copy_rows);
  m.impl("place_rows", &place_rows);
  m.impl("erase", &erase);
  m.impl("size", &size);
  m.impl("export", &export_slots);
  m.impl("bucket_of", &bucket_of);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "HSTU dynamic embedding kernels (ops under torch.ops.hstu_dynemb)";
}
