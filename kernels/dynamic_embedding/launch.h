// Host launchers of the dynamic-embedding kernels: plain pointers and a stream, no torch types,
// so the .cu files compile with nvcc alone. api.cpp checks inputs and calls these.
//
// Table layout (one table or one rank's shard): num_buckets * 32 slots; per slot keys[s]
// (kEmptyKey when free), scores[s], touched[s] (last training step that used the slot) and the
// fp32 row values[s * width : (s + 1) * width] = [embedding (dim) | optimizer state | padding].
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "hash.cuh"

namespace dynemb {

// slots[i] = slot of q[i] or -1. mode 0: read only; 1: found slots get touched = step and
// score = score_vals ? score_vals[i] : step; 2: like 1 but score += value. Modes 1/2 need unique q.
// step_ptr (device memory, may be null) overrides step: a CUDA graph replays it with the value
// of the moment.
void launch_find(const int64_t* keys, int64_t num_buckets, const int64_t* q, int64_t n,
                 int64_t* slots, int64_t* scores, int64_t* touched, const int64_t* score_vals,
                 int64_t step, const int64_t* step_ptr, int mode, cudaStream_t stream);

// Inserts absent unique keys grouped by bucket: segment g = new_keys[seg_offsets[g] :
// seg_offsets[g + 1]], all of bucket seg_buckets[g], in priority order. One warp per segment:
// candidates are ordered (empty, by lane) < (occupied and not touched at `step`, by score, key);
// the r-th key takes the r-th candidate; keys beyond the candidates get slot -1. The taken rows
// get the initial embedding; values == nullptr (a table without rows) places keys only.
// Segments with no keys are skipped. step_ptr as in launch_find.
void launch_insert(int64_t* keys, int64_t* scores, int64_t* touched, float* values, int64_t width,
                   int dim, const int64_t* new_keys, const int64_t* seg_offsets,
                   const int64_t* seg_buckets, int64_t num_segments, const int64_t* score_vals,
                   int64_t step, const int64_t* step_ptr, const InitParams& init,
                   int64_t* out_slots, int64_t* n_evicted, cudaStream_t stream);

// out[i, :dim] = values[slots[inverse[i]], :dim], zeros where that slot is -1.
void launch_gather(const float* values, int64_t width, int dim, const int64_t* slots,
                   const int64_t* inverse, int64_t n, float* out, cudaStream_t stream);

// dst[dst_idx[i], :] = src[src_idx[i], :] for i < n, rows of `width` floats (a multiple of 4),
// skipping every i whose dst_idx or src_idx is outside [0, rows). Either side may be page-locked
// host memory mapped for the GPU.
void launch_copy_rows(float* dst, int64_t dst_rows, const float* src, int64_t src_rows,
                      int64_t width, const int64_t* dst_idx, const int64_t* src_idx, int64_t n,
                      cudaStream_t stream);

// A hybrid table's training lookup: the HBM cache row of each unique id (rows_out, -1 where
// slots[i] < 0), hits kept, fresh keys (miss[i]) given their initial row in the row their slot
// already had or a free one, other misses fetched from the host tier (host: [slots, width],
// device-visible) into a free one; free rows popped from free_rows[0 : *n_free]. Updates
// row_keys / cache_slot (per cache row), slot_row (per slot) and counters[0, 2, 3] (fetched,
// hits, ids with a slot).
void launch_place_rows(float* cache, int64_t width, int dim, int64_t* row_keys,
                       int64_t* cache_slot, int* slot_row, const int64_t* free_rows,
                       int64_t* n_free, const float* host, const int64_t* slots, const bool* miss,
                       const int64_t* uniq, int64_t n, const InitParams& init, int64_t* rows_out,
                       int64_t* counters, cudaStream_t stream);

struct OptParams {
  int code;  // 0 sgd, 1 adam, 2 adagrad, 3 row-wise adagrad
  float lr, beta1, beta2, eps, weight_decay;
};

// Per unique id u (warp per id): g = sum of grad[perm[j]] for j in [offsets[u], offsets[u+1]),
// then the optimizer updates the row in place if keys[slots[u]] still equals uniq[u].
void launch_update(float* values, int64_t width, int dim, const int64_t* keys, const int64_t* uniq,
                   const int64_t* slots, const int64_t* perm, const int64_t* offsets,
                   const float* grad, int64_t num_unique, const OptParams& opt,
                   cudaStream_t stream);

// Removes unique keys q; *n_erased += how many were present.
void launch_erase(int64_t* keys, int64_t* scores, int64_t* touched, int64_t num_buckets,
                  const int64_t* q, int64_t n, int64_t* n_erased, cudaStream_t stream);

// *count = live slots (count must be zeroed).
void launch_size(const int64_t* keys, int64_t num_slots, int64_t* count, cudaStream_t stream);

// Writes the live slots to out (unordered); *count (zeroed) ends at their number.
void launch_export(const int64_t* keys, int64_t num_slots, int64_t* out, int64_t* count,
                   cudaStream_t stream);

void launch_bucket_of(const int64_t* keys, int64_t n, int64_t num_buckets, int64_t* out,
                      cudaStream_t stream);

}  // namespace dynemb
