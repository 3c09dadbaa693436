// Plain-C++ parameter block shared by the torch layer (api.cpp) and the kernels.
// No ATen/torch and no CuTe here: both a host compiler and nvcc include it.
#pragma once

#include <cstdint>

namespace hstu {

enum class DType : int { kFp16 = 0, kBf16 = 1 };

struct HstuParams {
  // Jagged [T, H, D] tensors, contiguous: row stride H * D, head stride D (elements).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;  // forward output

  const void* dout = nullptr;  // backward inputs/outputs
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* dq_accum = nullptr;  // [T, H, D] fp32, zero-initialised
  int* dq_semaphore = nullptr;  // [H, B, num_m_blocks] int32, zeroed; deterministic mode only
  // [H, B, ceil(max_seqlen / 64)] int32, zeroed (and left zeroed), or nullptr. When set (and not
  // deterministic), the backward converts dq_accum to dq itself: the last key block to reduce
  // into a query block converts it, and no separate convert kernel runs.
  int* dq_counter = nullptr;

  // Relative attention bias (bias.h, docs/design.md); all nullptr when there is none.
  const int64_t* timestamps = nullptr;  // [T] int64, jagged like q
  const float* pos_w = nullptr;         // [Hw, 2 max_pos + 1] fp32
  const float* time_w = nullptr;        // [Hw, num_buckets + 1] fp32
  const int64_t* time_edges = nullptr;  // [num_buckets + 1] int64
  // [B] int64 or nullptr: the time each sequence's last token queries at (e.g. the request
  // time); nullptr: its own timestamp
  const int64_t* last_query_time = nullptr;
  float* dpos_w = nullptr;              // backward: zeroed fp32 accumulators, same shapes
  float* dtime_w = nullptr;
  int64_t pos_w_head_stride = 0;   // 0: one row shared by every head
  int64_t time_w_head_stride = 0;
  int max_pos = 0;
  int num_buckets = 0;
  float inv_alpha = 1.f;  // the bias enters S as rab / alpha (alpha != 0 with a bias)

  int64_t row_stride = 0;
  int64_t head_stride = 0;

  const int* cu_seqlens = nullptr;    // [B + 1] int32
  // Forward only, queries against a cache (fwd_cached in api.cpp): when q_cu_seqlens is set, q
  // and o are jagged by it ([B + 1] int32) and sequence b's Lq queries are its last Lq positions
  // L - Lq .. L - 1; k, v and timestamps keep the cu_seqlens layout. seq_lens ([B] int32, or
  // nullptr for cu_seqlens[b + 1] - cu_seqlens[b]) gives L where a sequence's rows do not fill
  // its slot of the k/v buffers.
  const int* q_cu_seqlens = nullptr;
  const int* seq_lens = nullptr;
  int max_q_seqlen = 0;
  // Forward against a cache only: num_splits > 1 splits each query block's key blocks over
  // gridDim.y CTAs; each adds its partial output into o_accum ([rows of q, H, D] fp32, zeroed;
  // HSTU attention is a plain sum over keys, so partial outputs add) and o is left to the caller
  // (api.cpp converts o_accum). num_splits == 1: o written directly, o_accum unused.
  float* o_accum = nullptr;
  int num_splits = 1;
  const int* num_contexts = nullptr;  // [B] int32 or nullptr
  const int* num_targets = nullptr;   // [B] int32 or nullptr

  int batch = 0;
  int heads = 0;
  int head_dim = 0;
  int max_seqlen = 0;
  int total = 0;
  int target_group_size = 1;
  int window_size = 0;
  float alpha = 1.f;      // multiplies <q, k> before SiLU
  float inv_scale = 1.f;  // 1 / scaling_seqlen, multiplies SiLU(.)
  // When set: a float in device memory read in place of inv_scale (a CUDA graph replay takes the
  // batch's own scaling from it; the by-value field would repeat the captured batch's).
  const float* inv_scale_ptr = nullptr;
  // Grid order (grid_tile_of in utils.h, sized in launch.h): (sequence, head) pairs per dispatch
  // group, and the first pair of the last group (which takes the remaining pairs).
  int pair_group = 1;
  int last_group_first = 0;
  // The compacted grid (launch.h, compact_grid): CTA i runs tile tile_map[i] of the full grid
  // above (-1: nothing), so that no CTA is launched for a block past its sequence's end. Set
  // by the caller to a buffer of compact_grid_ctas(p, kTileMapBlock) ints; the launchers use it
  // where it pays (and set it to nullptr where not).
  int* tile_map = nullptr;
  bool causal = true;
  bool deterministic = false;
  DType dtype = DType::kBf16;
};

// The compacted grid (launch.h, compact_grid) for blocks of `block` rows: its CTA count,
// heads x floor((T + B (block - 1)) / block) >= heads x sum_b ceil(L_b / block), known on the
// host without the lengths; it pays where it is at most three quarters of the full grid's
// `full` CTAs. The tile map is sized for kTileMapBlock rows, the smallest block of any kernel
// (a larger block needs fewer CTAs).
constexpr int kTileMapBlock = 64;
inline int64_t compact_grid_ctas(HstuParams const& p, int block) {
  return int64_t(p.heads) * ((int64_t(p.total) + int64_t(p.batch) * (block - 1)) / block);
}
inline bool compact_grid_pays(int64_t compact, int64_t full) { return 4 * compact <= 3 * full; }

}  // namespace hstu
