// Hash table kernels: find (+ touch), insert with eviction, erase, size, export, bucket_of, and
// copy_rows and place_rows (the masked row copy and the cache placement of hybrid tables).
// Design (docs/kernels.md): buckets of 32 slots, one warp lane per slot. A key can only live in
// its bucket, so find is one coalesced 256-byte read and a ballot; there are no probe chains and
// no tombstones. Inserts are grouped by bucket on the host side (sort) and each bucket is owned
// by one warp, which makes eviction decisions deterministic and identical to the reference.
#include "launch.h"

namespace dynemb {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 256;

inline int grid_for(int64_t work_items, int per_block, int max_blocks = 65535 * 8) {
  int64_t g = (work_items + per_block - 1) / per_block;
  if (g < 1) g = 1;
  if (g > max_blocks) g = max_blocks;
  return static_cast<int>(g);
}

// Each warp takes 32 queries at a time: lane l loads query l and its bucket, then the warp walks
// the 32 queries, each lane comparing one slot of the bucket. Results leave coalesced.
__global__ void __launch_bounds__(kThreads) find_kernel(
    const int64_t* __restrict__ keys, int64_t num_buckets, const int64_t* __restrict__ q,
    int64_t n, int64_t* __restrict__ slots, int64_t* __restrict__ scores,
    int64_t* __restrict__ touched, const int64_t* __restrict__ score_vals, int64_t step_arg,
    const int64_t* __restrict__ step_ptr, int mode) {
  const int64_t step = step_ptr ? *step_ptr : step_arg;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t base = warp * 32; base < n; base += num_warps * 32) {
    const int64_t i = base + lane;
    const int64_t my_key = i < n ? q[i] : kEmptyKey;
    const int64_t my_bucket = i < n ? bucket_of(my_key, num_buckets) : 0;
    const int count = n - base < 32 ? static_cast<int>(n - base) : 32;
    int64_t my_slot = -1;
#pragma unroll 8
    for (int j = 0; j < 32; ++j) {
      if (j >= count) break;
      const int64_t k = __shfl_sync(kFull, my_key, j);
      const int64_t b = __shfl_sync(kFull, my_bucket, j);
      const int64_t s = b * kBucket + lane;
      const unsigned hit = __ballot_sync(kFull, __ldg(keys + s) == k && k != kEmptyKey);
      if (lane == j && hit) my_slot = b * kBucket + (__ffs(hit) - 1);
    }
    if (i < n) {
      slots[i] = my_slot;
      if (mode != 0 && my_slot >= 0) {
        const int64_t v = score_vals ? score_vals[i] : step;
        touched[my_slot] = step;
        scores[my_slot] = mode == 2 ? scores[my_slot] + v : v;
      }
    }
  }
}

// One warp per bucket segment. Lane l owns slot l of the bucket.
__global__ void __launch_bounds__(kThreads) insert_kernel(
    int64_t* __restrict__ keys, int64_t* __restrict__ scores, int64_t* __restrict__ touched,
    float* __restrict__ values, int64_t width, int dim, const int64_t* __restrict__ new_keys,
    const int64_t* __restrict__ seg_offsets, const int64_t* __restrict__ seg_buckets,
    int64_t num_segments, const int64_t* __restrict__ score_vals, int64_t step_arg,
    const int64_t* __restrict__ step_ptr, InitParams init, int64_t* __restrict__ out_slots,
    unsigned long long* __restrict__ n_evicted) {
  const int64_t step = step_ptr ? *step_ptr : step_arg;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t g = warp; g < num_segments; g += num_warps) {
    const int64_t b = seg_buckets[g];
    const int64_t lo = seg_offsets[g];
    const int64_t m = seg_offsets[g + 1] - lo;
    const int64_t slot = b * kBucket + lane;
    const int64_t k = keys[slot];
    const int cls = k == kEmptyKey ? 0 : (touched[slot] == step ? 2 : 1);
    // Order key (cls, score, key, lane); score and key only matter among evictable slots.
    const int64_t sc = cls == 1 ? scores[slot] : 0;
    const int64_t kk = cls == 1 ? k : 0;
    int rank = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int cj = __shfl_sync(kFull, cls, j);
      const int64_t sj = __shfl_sync(kFull, sc, j);
      const int64_t kj = __shfl_sync(kFull, kk, j);
      const bool less =
          cj < cls ||
          (cj == cls && (sj < sc || (sj == sc && (kj < kk || (kj == kk && j < lane)))));
      rank += less ? 1 : 0;
    }
    const bool eligible = cls != 2;
    const int num_eligible = __popc(__ballot_sync(kFull, eligible));
    const bool take = eligible && rank < m;
    int64_t nk = kEmptyKey;
    if (take) {
      nk = new_keys[lo + rank];
      keys[slot] = nk;
      scores[slot] = score_vals[lo + rank];
      touched[slot] = step;
      out_slots[lo + rank] = slot;
    }
    for (int64_t r = num_eligible + lane; r < m; r += 32) out_slots[lo + r] = -1;
    const unsigned evict_mask = __ballot_sync(kFull, take && cls == 1);
    if (lane == 0 && evict_mask) atomicAdd(n_evicted, __popc(evict_mask));
    // Initialise the taken rows, the whole warp writing one row at a time (coalesced); a table
    // without rows (values == nullptr: a hybrid table's slot directory) only places keys.
    unsigned taken = values != nullptr ? __ballot_sync(kFull, take) : 0u;
    while (taken) {
      const int l = __ffs(taken) - 1;
      taken &= taken - 1;
      const int64_t key = __shfl_sync(kFull, nk, l);
      write_initial_row(values + (b * kBucket + l) * width, width, dim, init, key, lane);
    }
  }
}

__global__ void erase_kernel(int64_t* __restrict__ keys, int64_t* __restrict__ scores,
                             int64_t* __restrict__ touched, int64_t num_buckets,
                             const int64_t* __restrict__ q, int64_t n,
                             unsigned long long* __restrict__ n_erased) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t i = warp; i < n; i += num_warps) {
    const int64_t k = q[i];
    const int64_t s = bucket_of(k, num_buckets) * kBucket + lane;
    const bool hit = keys[s] == k && k != kEmptyKey;
    if (hit) {
      keys[s] = kEmptyKey;
      scores[s] = 0;
      touched[s] = 0;
    }
    const unsigned m = __ballot_sync(kFull, hit);
    if (lane == 0 && m) atomicAdd(n_erased, static_cast<unsigned long long>(__popc(m)));
  }
}

__global__ void size_kernel(const int64_t* __restrict__ keys, int64_t num_slots,
                            unsigned long long* __restrict__ count) {
  unsigned long long local = 0;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < num_slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    local += keys[s] != kEmptyKey;
  }
  for (int o = 16; o > 0; o >>= 1) local += __shfl_down_sync(kFull, local, o);
  if ((threadIdx.x & 31) == 0 && local) atomicAdd(count, local);
}

__global__ void export_kernel(const int64_t* __restrict__ keys, int64_t num_slots,
                              int64_t* __restrict__ out, unsigned long long* __restrict__ count) {
  const int lane = threadIdx.x & 31;
  for (int64_t base = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) & ~31ll;
       base < num_slots; base += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = base + lane;
    const bool live = s < num_slots && keys[s] != kEmptyKey;
    const unsigned m = __ballot_sync(kFull, live);
    unsigned long long pos = 0;
    if (lane == 0 && m) pos = atomicAdd(count, static_cast<unsigned long long>(__popc(m)));
    pos = __shfl_sync(kFull, pos, 0);
    if (live) out[pos + __popc(m & ((1u << lane) - 1u))] = s;
  }
}

__global__ void bucket_of_kernel(const int64_t* __restrict__ keys, int64_t n, int64_t nb,
                                 int64_t* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = bucket_of(keys[i], nb);
  }
}

// One warp per pair i: dst[dst_idx[i]] = src[src_idx[i]] in 16-byte words, skipped where
// either index is outside its tensor (-1 marks the pairs a padded caller does not use).
__global__ void __launch_bounds__(kThreads) copy_rows_kernel(
    float4* __restrict__ dst, int64_t dst_rows, const float4* __restrict__ src, int64_t src_rows,
    int64_t words, const int64_t* __restrict__ dst_idx, const int64_t* __restrict__ src_idx,
    int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t i = warp; i < n; i += num_warps) {
    const int64_t d = dst_idx[i];
    const int64_t s = src_idx[i];
    if (d < 0 || d >= dst_rows || s < 0 || s >= src_rows) continue;
    for (int64_t w = lane; w < words; w += 32) dst[d * words + w] = src[s * words + w];
  }
}

// One warp per unique id i of a hybrid table's training lookup: lane 0 finds the id's cache row,
// the warp fills it. s = slots[i] (-1: the directory had no room: rows[i] = -1) and cur =
// slot_row[s]:
// - miss[i] (the key took slot s in this lookup): the row cached for the slot's former key is
//   reused if there is one, else a free row is taken; it gets the key's initial row;
// - else cur >= 0 (a hit): rows[i] = cur;
// - else a free row is taken and filled from the host tier's row s (over PCIe when mapped).
// Free rows are popped from free_rows[0 : *n_free] with an atomic on n_free: the caller makes
// sure there are enough, so only which free row an id gets varies from run to run.
// counters[0] += rows fetched, counters[2] += hits, counters[3] += ids with a slot.
__global__ void __launch_bounds__(kThreads) place_rows_kernel(
    float* __restrict__ cache, int64_t width, int dim, int64_t* __restrict__ row_keys,
    int64_t* __restrict__ cache_slot, int* __restrict__ slot_row,
    const int64_t* __restrict__ free_rows, unsigned long long* __restrict__ n_free,
    const float4* __restrict__ host, const int64_t* __restrict__ slots,
    const bool* __restrict__ miss, const int64_t* __restrict__ uniq, int64_t n, InitParams init,
    int64_t* __restrict__ rows_out, unsigned long long* __restrict__ counters) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  unsigned long long fetched = 0, hits = 0, live = 0;  // lane 0's counts
  for (int64_t i = warp; i < n; i += num_warps) {
    const int64_t s = slots[i];
    int64_t row = -1;
    int mode = 0;  // 0: nothing to fill, 1: from the host tier, 2: initial row
    if (lane == 0 && s >= 0) {
      ++live;
      const int64_t cur = slot_row[s];
      const bool fresh = miss[i];
      if (!fresh && cur >= 0) {
        row = cur;
        ++hits;
      } else {
        if (fresh && cur >= 0) {
          row = cur;
        } else {
          const long long left = static_cast<long long>(atomicAdd(n_free, ~0ull));  // n_free - 1
          if (left > 0) {
            row = free_rows[left - 1];
          } else {
            atomicAdd(n_free, 1ull);  // (cannot happen: the caller reserved the rows)
          }
        }
        if (row >= 0) {
          mode = fresh ? 2 : 1;
          fetched += fresh ? 0 : 1;
          row_keys[row] = uniq[i];
          cache_slot[row] = s;
          slot_row[s] = static_cast<int>(row);
        }
      }
    }
    if (lane == 0) rows_out[i] = row;
    row = __shfl_sync(kFull, row, 0);
    mode = __shfl_sync(kFull, mode, 0);
    if (mode == 1) {
      const int64_t words = width / 4;
      float4* dst = reinterpret_cast<float4*>(cache + row * width);
      const int64_t src = __shfl_sync(kFull, s, 0) * words;
      for (int64_t w = lane; w < words; w += 32) dst[w] = host[src + w];
    } else if (mode == 2) {
      write_initial_row(cache + row * width, width, dim, init, uniq[i], lane);
    }
  }
  if (lane == 0 && live) {
    atomicAdd(counters + 0, fetched);
    atomicAdd(counters + 2, hits);
    atomicAdd(counters + 3, live);
  }
}

}  // namespace

void launch_place_rows(float* cache, int64_t width, int dim, int64_t* row_keys,
                       int64_t* cache_slot, int* slot_row, const int64_t* free_rows,
                       int64_t* n_free, const float* host, const int64_t* slots, const bool* miss,
                       const int64_t* uniq, int64_t n, const InitParams& init, int64_t* rows_out,
                       int64_t* counters, cudaStream_t stream) {
  if (n == 0) return;
  place_rows_kernel<<<grid_for(n, kThreads / 32), kThreads, 0, stream>>>(
      cache, width, dim, row_keys, cache_slot, slot_row, free_rows,
      reinterpret_cast<unsigned long long*>(n_free), reinterpret_cast<const float4*>(host), slots,
      miss, uniq, n, init, rows_out, reinterpret_cast<unsigned long long*>(counters));
}

void launch_copy_rows(float* dst, int64_t dst_rows, const float* src, int64_t src_rows,
                      int64_t width, const int64_t* dst_idx, const int64_t* src_idx, int64_t n,
                      cudaStream_t stream) {
  if (n == 0) return;
  copy_rows_kernel<<<grid_for(n, kThreads / 32), kThreads, 0, stream>>>(
      reinterpret_cast<float4*>(dst), dst_rows, reinterpret_cast<const float4*>(src), src_rows,
      width / 4, dst_idx, src_idx, n);
}

void launch_find(const int64_t* keys, int64_t num_buckets, const int64_t* q, int64_t n,
                 int64_t* slots, int64_t* scores, int64_t* touched, const int64_t* score_vals,
                 int64_t step, const int64_t* step_ptr, int mode, cudaStream_t stream) {
  if (n == 0) return;
  // 8 warps per block, 32 queries per warp.
  find_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(
      keys, num_buckets, q, n, slots, scores, touched, score_vals, step, step_ptr, mode);
}

void launch_insert(int64_t* keys, int64_t* scores, int64_t* touched, float* values, int64_t width,
                   int dim, const int64_t* new_keys, const int64_t* seg_offsets,
                   const int64_t* seg_buckets, int64_t num_segments, const int64_t* score_vals,
                   int64_t step, const int64_t* step_ptr, const InitParams& init,
                   int64_t* out_slots, int64_t* n_evicted, cudaStream_t stream) {
  if (num_segments == 0) return;
  insert_kernel<<<grid_for(num_segments, kThreads / 32), kThreads, 0, stream>>>(
      keys, scores, touched, values, width, dim, new_keys, seg_offsets, seg_buckets, num_segments,
      score_vals, step, step_ptr, init, out_slots,
      reinterpret_cast<unsigned long long*>(n_evicted));
}

void launch_erase(int64_t* keys, int64_t* scores, int64_t* touched, int64_t num_buckets,
                  const int64_t* q, int64_t n, int64_t* n_erased, cudaStream_t stream) {
  if (n == 0) return;
  erase_kernel<<<grid_for(n, kThreads / 32), kThreads, 0, stream>>>(
      keys, scores, touched, num_buckets, q, n, reinterpret_cast<unsigned long long*>(n_erased));
}

void launch_size(const int64_t* keys, int64_t num_slots, int64_t* count, cudaStream_t stream) {
  size_kernel<<<grid_for(num_slots, kThreads * 8, 4096), kThreads, 0, stream>>>(
      keys, num_slots, reinterpret_cast<unsigned long long*>(count));
}

void launch_export(const int64_t* keys, int64_t num_slots, int64_t* out, int64_t* count,
                   cudaStream_t stream) {
  export_kernel<<<grid_for(num_slots, kThreads, 4096), kThreads, 0, stream>>>(
      keys, num_slots, out, reinterpret_cast<unsigned long long*>(count));
}

void launch_bucket_of(const int64_t* keys, int64_t n, int64_t num_buckets, int64_t* out,
                      cudaStream_t stream) {
  if (n == 0) return;
  bucket_of_kernel<<<grid_for(n, kThreads, 4096), kThreads, 0, stream>>>(keys, n, num_buckets,
                                                                          out);
}

}  // namespace dynemb
