// Where a (sequence, layer) keeps its data on a CUDA device, and the dimensions every kernel needs.
//
// One `layer_view` per (slot, layer) lives in device memory (an array indexed slot * num_layers + layer). Its
// pointers are fixed when the store is built (arenas are reserved up front from the configured capacity); its
// counters are written by the prefill and then advanced by the decode kernels themselves (append, fold), so a decode
// step needs no per-step upload from the host and its kernels have shapes that depend only on the batch size:
// the step can be captured in a CUDA graph. The host keeps its own mirror of the counters (kv_store's layer_state)
// for validation; both advance by the same rules (docs/semantics.md).
//
// Element type `T` of keys/values/landmarks is the store's dtype (__nv_bfloat16, __half or float); pointers to them
// are `void*` here and cast by the kernels, which are templated on T.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace shadowkv::cuda {

/// Shapes and parameters shared by all kernels (passed by value).
struct dims {
  int num_layers;
  int q_heads;         ///< Hq
  int kv_heads;        ///< Hkv
  int head_dim;        ///< D
  int group;           ///< G = Hq / Hkv
  int chunk;           ///< C
  int budget;          ///< k, chunks a selection takes per KV head (miss and selection lists have k entries)
  int max_outliers;    ///< O (per head; actual count is layer_view::outlier_chunks)
  int rank;            ///< r
  int window;          ///< W, generated ring capacity in tokens
  int local_capacity;  ///< rows reserved for the local window: (local_chunks + 1) * C - 1
  int max_chunks;      ///< context chunk capacity: max_seq_len / C
  int rotary_dim;
  int rope_interleaved;  ///< 0: half-split, 1: interleaved
  float attention_scaling;
  float softmax_scale;
  int value_fp8;       ///< 1: the value store holds e4m3 codes + a float32 scale per run (shadowkv/fp8.hpp)
  int factor_bf16;     ///< 1: basis and coefficients are bf16 (config::factor_dtype()), 0: float32
  int group_mean;      ///< 1: a chunk's score is the mean of the group's probabilities (config::group_score), 0: max
  // Last, so that the offsets of the fields above (and the code of the default cache's kernels) stay as they were.
  int cache_slots;     ///< K >= k, selection-cache slots per KV head (config::cache_slots()); K == k: the cache
                       ///< holds exactly the last selection, K > k: slots keep their chunk until evicted (LRU)
  int chunk_centroids;  ///< 1: chunks are scored by two centroids (config::chunk_score two_centroids,
                        ///< shadowkv/chunk_centroids.hpp) held in layer_view::centroid_*, not by landmarks
  int attention_early;  ///< 1: the key rebuild releases the attention's launch at its start, and the tensor-core
                        ///< attention walks its rows and stages q before it waits for the rebuild
                        ///< (sparse_attention.cu; the backend's choice by batch, pipeline_plan.hpp), 0: the attention
                        ///< starts after it
  int fused_misses;  ///< 1: the key rebuild also attends over the rows it rebuilds (a partial per group of misses,
                     ///< chunk_rebuild.cuh's miss_attention) and the attention walks only the other rows, without
                     ///< waiting for the rebuild (sparse_attention.cu); the backend's choice per step
                     ///< (pipeline_plan.hpp), 0: the rebuild writes keys, the attention reads every row
  int journal_chunks;  ///< folded chunks whose exact rows the fold journal keeps (config::journal_chunks() + 1: one
                       ///< more for a ring the device folds at the end of the step that filled it, which the host
                       ///< still counts as unfolded); 0: no journal
};

/// Everything of one (slot, layer) on the device. Row-major, head-major where a kernel reads one head at a time.
struct layer_view {
  // Counters (device-owned during decode).
  int prompt_len;
  int context_chunks;       ///< prompt context chunks + folded chunks
  int outlier_chunks;       ///< per head
  int local_len;            ///< exact rows [0, local_len) of the exact region
  int generated_exact_len;  ///< exact generated tokens in the ring
  int ring_head;            ///< ring slot of the oldest generated token
  long long last_position;

  // Low-rank keys, float32 or bf16 (dims::factor_bf16).
  void* basis;                   ///< B [r, Hkv*D]
  void* coefficients;            ///< A [max_chunks*C, r]
  long long* context_positions;  ///< [max_chunks*C]
  // Selection data.
  void* landmarks;               ///< T [Hkv, max_chunks, D]
  std::uint8_t* is_outlier;      ///< [Hkv, max_chunks]
  // Exact data.
  void* outlier_keys;            ///< T [Hkv, O*C, D] post-RoPE (first outlier_chunks*C rows valid)
  void* outlier_values;          ///< T [Hkv, O*C, D]
  void* exact_keys;              ///< T [Hkv, local_capacity + W, D]: local window rows, then the generated ring
  void* exact_values;            ///< T [Hkv, local_capacity + W, D]
  long long* exact_positions;    ///< [local_capacity + W]
  // Selection cache of K = dims::cache_slots slots per head.
  int* cache_chunks;             ///< [Hkv, K]: chunk id per buffer slot, -1 = empty
  int* slot_of_chunk;            ///< [Hkv, max_chunks]: buffer slot holding a chunk, -1 = none
  void* cache_keys;              ///< T [Hkv, K*C, D] rebuilt post-RoPE keys
  void* cache_values;            ///< T [Hkv, K*C, D] fetched values
  // Value store in device memory or pinned, mapped host memory (device-accessible pointers), set when a sequence
  // joins the slot.
  void* value_store;             ///< T [max_chunks, Hkv, C, D]: one (chunk, head) = one contiguous run; fp8: codes
  float* value_scales;           ///< fp8 only: [max_chunks, Hkv] scale of each run
  // The selection cache's LRU state, only when K > k (null otherwise: with K == k every filled slot is selected).
  // Reset by the prefill; advanced by the select kernel, so that graph replays keep it exact
  // (cpp/src/lru_selection_cache.hpp is the rule). Last, so that the offsets of the fields above stay as they were.
  long long* cache_last_used;    ///< [Hkv, K]: the selection number that last selected the slot's chunk (0: never)
  long long* selection_clock;    ///< [Hkv]: selections of this (sequence, layer) so far, one copy per head (each
                                 ///< select CTA advances its own: no CTA waits for another's read)
  int* selected_slots;           ///< [Hkv, k]: the slots of the last selection, ascending, -1 padding (attention)
  // Two-centroid chunk scores (dims::chunk_centroids; null otherwise, and `landmarks` is then null).
  std::uint8_t* centroid_codes;  ///< [Hkv, max_chunks, 2 * D] e4m3 codes: centroid 1, then centroid 2
  float* centroid_scales;        ///< [Hkv, max_chunks, 2]
  std::uint8_t* first_counts;    ///< [Hkv, max_chunks]: keys in the first cluster
  // [Hkv] radix key where the last selection's scores put the count from the top at 2k (select_kernel.cu's hint
  // path; 0: none). Only a place to start from: any value gives the same selection. Null: no hints.
  unsigned* selection_hint;
  // The fold journal (docs/semantics.md, "Truncate"): the exact rows of the newest dims::journal_chunks folded chunks,
  // a ring of chunks written by the fold, read back by truncate.
  void* journal_keys;             ///< T [Hkv, journal_chunks * C, D] post-RoPE
  void* journal_values;           ///< T [Hkv, journal_chunks * C, D]
  long long* journal_positions;   ///< [journal_chunks * C]
  int journal_head;               ///< journal chunk of the oldest fold kept
  int journal_count;              ///< folds kept (<= journal_chunks)
  // A forked sequence's value store (docs/semantics.md, "Fork, park and save"): the runs of its first
  // shared_value_chunks context chunks (the prompt's) are read from the family's value store at shared_value_store,
  // which nothing writes after the prefill; its own chunks are at value_store, chunk c at c - shared_value_chunks.
  // 0 for a sequence that shares nothing: value_store holds every chunk at its id.
  const void* shared_value_store;
  const float* shared_value_scales;  ///< fp8 only
  int shared_value_chunks;
};

/// Where the value runs of context chunk `chunk` are read: the store (codes for fp8), its fp8 scales, and the chunk's
/// index in them (see layer_view::shared_value_chunks).
struct value_runs {
  const void* store;
  const float* scales;
  long long chunk;
};
__host__ __device__ inline value_runs value_runs_of(const layer_view& view, long long chunk) {
  if (chunk < view.shared_value_chunks) return {view.shared_value_store, view.shared_value_scales, chunk};
  return {view.value_store, view.value_scales, chunk - view.shared_value_chunks};
}

/// Ring row of the i-th oldest generated token (0 <= i < generated_exact_len) in the exact region.
__host__ __device__ inline int generated_row(const layer_view& view, const dims& d, int i) {
  return d.local_capacity + (view.ring_head + i) % d.window;
}

/// Per-step workspace of a decode batch (device memory, reserved for max_batch sequences).
struct step_workspace {
  float* logits;       ///< [max_batch, Hq, max_chunks]
  float* scores;       ///< [max_batch, Hkv, max_chunks]
  int* selected;       ///< [max_batch, Hkv, k] selected chunk ids, ascending; -1 padding
  int* miss_slots;     ///< [max_batch, Hkv, k] buffer slots to fill this step
  int* miss_counts;    ///< [max_batch, Hkv]
  unsigned long long* counters;  ///< [4]: hits, misses, selections, bytes fetched (accumulated)
  float* partial;      ///< attention split partials [max_batch, Hq, max_splits, D + 2]
  int max_splits;
  // The chunk selection's own rows, sized by launch_select_chunks' query (chunk_selection_workspace):
  float* selection_partials;  ///< [max_batch, Hkv, G, logit tiles, 2]: softmax partials (max, sum exp) per tile
  unsigned* radix_keys;       ///< [max_batch, Hkv, max_chunks]: per-chunk radix keys when they do not fit in the
                              ///< select kernel's shared memory (null when they do)
  unsigned* logits_claims;    ///< [2], zero between launches: the decode logits' tile pool (claimed tiles, CTAs
                              ///< done; landmark_logits.cu); null: no pool
  unsigned long long* hinted_selections;  ///< [1] or null: selections that took the select cluster's hint path
                                          ///< (accumulated; tests and measurements)
  // The store's RoPE coefficients by position (rope_table.cuh), read by the key rebuild; null: none (every row's
  // coefficients are computed, as for positions outside the table).
  const float2* rope_table;       ///< [rope_table_positions, rotary_dim / 2]
  long long rope_table_positions;
};

}  // namespace shadowkv::cuda

namespace shadowkv::cuda {

/// Element type codes of caller tensors (same order as shadowkv::dtype).
enum element_type : int { element_f32 = 0, element_f16 = 1, element_bf16 = 2 };

/// A caller tensor as kernels take it: data, element type and strides in elements (up to 4 dims).
struct strided_tensor {
  const void* data;
  int type;  ///< element_type
  long long stride[4];
};

}  // namespace shadowkv::cuda
