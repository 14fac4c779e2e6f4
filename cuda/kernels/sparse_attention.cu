// Split-KV ("flash-decoding") exact attention over the sparse union of one (sequence, layer).
//
// Two kernels per launch, both with shapes that depend only on the dims and the batch size (CUDA-graph capturable):
//
// 1. split kernel, grid (split, KV head h, entry b), 128 threads. The CTA reads the counters of its layer_view and
//    walks its share of the virtual row list of head h
//        [outlier rows | local rows | generated ring rows | cache slot rows],
//    where the cache part spans buffer slots 0 .. (last filled slot) and rows of empty slots (-1) in the middle are
//    skipped (masked) rather than compacted: empty slots only exist while a sequence has fewer candidate chunks than
//    the budget, and masking keeps the row -> address map a few integer ops with no shared-memory slot list. With a
//    cache larger than the budget (K > k) the cache part is the k entries of selected_slots instead (the selected
//    slots, ascending, compacted by the select kernel): slots cached but not selected are never read. The
//    split's share is a contiguous range of ceil(N / splits) rows of the N actual rows, so a short sequence in a
//    ragged batch costs what it holds.
//    Rows stream through a multi-stage shared-memory pipeline (cp.async, 16 bytes per copy, 2-8 stages in <= 40 KiB
//    of dynamic shared memory per CTA, or 2 stages when they need more, so the bytes in flight do not cost
//    registers): a stage holds the K and V rows of one compute step and the producing threads note which of its rows
//    are tokens. A row is read from shared
//    memory by a *row slot* of L lanes (L = the row's 16-byte vectors rounded up to a power of two, at most 32),
//    each lane holding one or two 16-byte vectors of it and, in registers, the matching slice of its query heads
//    (pre-scaled by softmax_scale * log2 e) and their online-softmax state (max, sum, acc) in float32. A query tile
//    of G_t <= 8 heads is split over 1 or 2 slots that read the same rows (cta_layout: at most 32 query floats per
//    lane). Per step a slot reduces its heads x U partial dot products across its L lanes with xor shuffles and
//    updates its state. At the end the slots merge by shuffles, then through shared memory, and the CTA writes, per
//    query head j, the partial (max in log2 units, sum, unnormalised acc[D]) to partial[b, j, split, 0 .. D+2).
//    The CTA loops over query tiles when G > 8 (each tile re-reads the CTA's rows, mostly from L2). A CTA whose
//    range is empty writes the neutral partial (-inf, 0, 0...).
//    For bf16 keys and values with D <= 128 the tensor-core split kernel (sparse_attention_mma_kernel, below) takes
//    its place: same grid, row walk and partials, Q K^T and P V on mma.sync (the FMA one serves every other shape).
// 2. combine kernel, grid (query head, entry): weights 2^(max_s - max) per split, out = sum_s w_s acc_s / sum_s w_s l_s
//    written in out.type with out.stride (0 when no row at all exists).
// A fused step (dims::fused_misses, off by default): the split kernel walks only the rows of the slots this step did
// not miss, beside the key rebuild, which attends over the missed rows itself (chunk_rebuild.cuh, miss_attention) and
// writes its partials after the splits'; the combine merges both. (The same merge by the split kernel's CTA
//    that finished last for its (entry, KV head), counted in a workspace array, measured no faster on the H200: slower
//    at B = 1's 33 splits a head, level at B = 8 and 24; docs/performance.md; session 18. Session 29's, a warp a query
//    head and all of a lane's loads in flight, bit-identical to the combine: +2.5 µs at B = 1 fused, level at 2-24.)
//
// Requires 16-byte aligned key/value arrays (the store's arenas are); rows are then aligned too since
// D * sizeof(T) is a multiple of 16 for every supported D.
#include "sparse_attention.cuh"

#include "chunk_rebuild.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/async_copy.cuh"
#include "common/bf16_mma.cuh"
#include "common/dependent_launch.cuh"
#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "common/float_constants.cuh"
#include "common/phase_stamps.cuh"
#include "cuda_check.hpp"
#include "shadowkv/errors.hpp"
#include "shadowkv/generated_region.hpp"
#include "shape_support.hpp"

namespace shadowkv::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kCombineThreads = 128;
constexpr int kCombineBatch = 24;  // splits whose partial accumulators one merging thread loads together
/// Partials a query head can have: the attention's splits (sparse_attention_max_splits: 64 at most) and, in a fused
/// step, the key rebuild's groups after them (the combine kernel keeps one weight per partial in shared memory).
constexpr int kMaxSplits = 128;
constexpr int kMaxAttentionSplits = 64;
/// CTAs a fused step's attention (dims::fused_misses) aims for: one beside each key-rebuild CTA, whose shared memory
/// leaves room for one (chunk_rebuild.cu), on the H200's 132 SMs.
constexpr int kFusedTargetCtas = 128;
/// A split should have at least this many rows of the largest possible row list: below it the CTA's fixed costs
/// (counters, query, partial write, combine) outweigh its rows.
constexpr int kMinRowsPerSplit = 64;
/// CTAs the split count aims for: one wave at 3 CTAs per SM of an H200 (132 SMs). A constant, not the device's SM
/// count, so that the split count (and with it the rounding of the result) depends only on the dims and the batch.
constexpr int kTargetCtas = 132 * 3;
/// Shared memory for the K/V pipeline stages of one CTA. At least two stages are kept, so a step larger than half of
/// this (fp32, D = 256, 4 heads per lane: 32 KiB) takes more (64 KiB, over the 48 KiB default; see launch_split).
/// (64 KiB, i.e. four stages instead of two for bf16 D = 128, measured slower on the H200: B=8 48 µs against 45, B=24
/// 221 against 200; docs/performance.md; session 9.)
constexpr int kPipelineBytes = 40 * 1024;
/// Shared memory (static and dynamic) a CTA may use without the opt-in attribute.
constexpr int kDefaultSharedBytes = 48 * 1024;
/// Entries of the cache's slot list (dims::budget) that the split kernel keeps in shared memory; a larger budget
/// reads the list from global memory. Each pipeline step looks up its rows' list entries before it can issue their
/// copies, so a list in global memory put an L2 round trip in front of every step's copies.
constexpr int kSharedSlotEntries = 1024;

constexpr int next_power_of_two(int n) { return n <= 1 ? 1 : 2 * next_power_of_two((n + 1) / 2); }

/// How the CTA's threads share rows and query heads.
///
/// A row of D elements of T is `vectors` 16-byte vectors, spread over a *row slot* of `lanes` lanes (the vector
/// count rounded up to a power of two, at most 32; lanes past the row idle). Each lane keeps the query slices and
/// accumulators of `heads_per_lane` query heads in registers (at most 32 floats each, so that a tile of 8 heads
/// does not exhaust the register file); the `head_parts` = HeadTile / heads_per_lane slots of one *row group* read
/// the same rows and each works for its own part of the query heads.
template <typename T, int D, int HeadTile>
struct cta_layout {
  static constexpr int vec = 16 / static_cast<int>(sizeof(T));  ///< elements per 16-byte vector
  static_assert(D % vec == 0, "rows must be whole 16-byte vectors");
  static constexpr int vectors = D / vec;
  static constexpr int lanes = next_power_of_two(vectors) < 32 ? next_power_of_two(vectors) : 32;
  static constexpr int per_lane = (vectors + lanes - 1) / lanes;  ///< 16-byte vectors per lane
  static constexpr int elements = per_lane * vec;                 ///< row elements per lane
  static constexpr int slots_per_warp = 32 / lanes;
  static constexpr int slots = kWarps * slots_per_warp;
  static constexpr int heads_per_lane = HeadTile * elements <= 32 ? HeadTile : std::max(1, 32 / elements);
  static constexpr int head_parts = HeadTile / heads_per_lane;
  static_assert(HeadTile % heads_per_lane == 0 && slots % head_parts == 0, "head parts must tile the slots");
  static constexpr int groups = slots / head_parts;  ///< row groups: distinct rows per CTA and row of a step
  static constexpr int parts_in_warp = std::min(head_parts, slots_per_warp);
  static constexpr int warps_per_group = head_parts / parts_in_warp;
  static constexpr int units = kWarps / warps_per_group;  ///< per-warp(-pair) partial states merged in shared memory
  /// Rows per row group and step: 4 amortises the per-step softmax bookkeeping over more rows when a lane serves
  /// 4+ heads (measured on an H200: 2.1 vs 1.9 TB/s at G=4), 2 is better for 1-2 heads; the heads x rows scores stay
  /// in registers (<= 16).
  static constexpr int rows_per_group = heads_per_lane >= 4 ? std::max(1, std::min(4, 16 / heads_per_lane)) : 2;
  static constexpr int step_rows = groups * rows_per_group;  ///< rows per pipeline stage
  static constexpr int stage_bytes = 2 * step_rows * D * static_cast<int>(sizeof(T));  ///< K and V
  static constexpr int stages = std::max(2, std::min(8, kPipelineBytes / stage_bytes));
  static constexpr int pipeline_bytes = stages * stage_bytes;
  static constexpr int reduction_bytes = units * HeadTile * (D + 2) * static_cast<int>(sizeof(float));
  static constexpr int shared_bytes = std::max(pipeline_bytes, reduction_bytes);  ///< dynamic, at launch
  /// The kernel's static shared arrays (warp_last_filled, row_is_token, shared_slots), with room for their alignment.
  static constexpr int static_bytes = kWarps * static_cast<int>(sizeof(int)) + stages * step_rows + 16 +
                                      kSharedSlotEntries * static_cast<int>(sizeof(int));
};

/// The virtual row list of one (sequence, KV head), [outlier rows | local rows | generated ring rows | cache rows],
/// and one split's contiguous share [row_begin, row_end) of it (see the file comment, 1.). Made by begin_row_walk.
template <typename T, int D, bool kListed>
struct row_walk {
  const int* slot_list;  ///< the cache part's list (shared memory when it fits)
  int chunk;
  int chunk_shift;  ///< log2(chunk), or -1 when chunk is not a power of two
  int local_capacity;
  int window;
  int outlier_rows;
  int local_rows;
  int generated_rows;
  int ring_head;  ///< view->ring_head, read with the view's other fields at the start
  int row_begin;
  int row_end;
  const T* outlier_keys;
  const T* outlier_values;
  const T* exact_keys;
  const T* exact_values;
  const T* cache_keys;
  const T* cache_values;

  __device__ __forceinline__ int entry_of(int cache_row) const {
    return chunk_shift >= 0 ? cache_row >> chunk_shift : cache_row / chunk;
  }

  /// Whether row i is a token (false past the split's range and in empty cache slots).
  __device__ __forceinline__ bool valid(int i) const {
    if (i >= row_end) return false;
    const int cache_row = i - (outlier_rows + local_rows + generated_rows);
    if (cache_row < 0) return true;
    return slot_list[entry_of(cache_row)] >= 0;
  }

  /// Row i -> its key and value rows.
  __device__ __forceinline__ void locate(int i, const T*& key, const T*& value) const {
    if (i < outlier_rows) {
      key = outlier_keys + static_cast<long long>(i) * D;
      value = outlier_values + static_cast<long long>(i) * D;
      return;
    }
    i -= outlier_rows;
    if (i < local_rows + generated_rows) {
      const int row = i < local_rows ? i : local_capacity + rules::ring_row(ring_head, i - local_rows, window);
      key = exact_keys + static_cast<long long>(row) * D;
      value = exact_values + static_cast<long long>(row) * D;
      return;
    }
    i -= local_rows + generated_rows;  // a cache row of list entry e = i / C: buffer slot e (K == k) or slot_list[e]
    if constexpr (kListed) {
      const int entry = entry_of(i);
      i += (slot_list[entry] - entry) * chunk;
    }
    key = cache_keys + static_cast<long long>(i) * D;
    value = cache_values + static_cast<long long>(i) * D;
  }
};

/// A fused step's miss lists (dims::fused_misses; step_workspace::miss_slots and miss_counts of the launch's part):
/// the attention walks the other rows, the key rebuild attends over these (chunk_rebuild.cuh, miss_attention).
struct miss_lists {
  const int* slots = nullptr;   ///< [batch, Hkv, k]
  const int* counts = nullptr;  ///< [batch, Hkv]; null: not a fused step
};

/// The selection's slots of (entry, KV head h) that this step did not miss, ascending, into hit_slots; returns how
/// many. The selection: every filled slot (K == k) or the slots of selected_slots (K > k). `missed`: cache_slots
/// bytes of shared memory, `warp_counts`: kBlockThreads / 32 ints. Every global load is issued at once (the miss
/// list's k entries whatever the count, the selection's list); then the flags, then rounds of kBlockThreads entries,
/// ranked by ballots. Called by every thread of a block of kBlockThreads threads; ends with a barrier. Needs
/// k <= kSharedSlotEntries and K <= kSharedSlotEntries (the backend fuses only then).
template <int kBlockThreads>
__device__ __forceinline__ int compact_hit_slots(const dims& d, const layer_view& view, int h, long long pair,
                                                 const miss_lists& misses, int* hit_slots, unsigned char* missed,
                                                 int* warp_counts) {
  constexpr int kPerThread = kSharedSlotEntries / kBlockThreads;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32;
  const int warp = tid / 32;
  const bool listed = d.cache_slots > d.budget;
  const int* const list = listed ? view.selected_slots + static_cast<long long>(h) * d.budget
                                 : view.cache_chunks + static_cast<long long>(h) * d.cache_slots;
  const int* const miss_list = misses.slots + pair * d.budget;
  const int miss_count = misses.counts[pair];
  int miss_entry[kPerThread];
  int list_entry[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int s = tid + i * kBlockThreads;
    miss_entry[i] = s < d.budget ? miss_list[s] : -1;
    list_entry[i] = s < d.budget ? list[s] : -1;
  }
  for (int slot = tid; slot < d.cache_slots; slot += kBlockThreads) missed[slot] = 0;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (tid + i * kBlockThreads < miss_count) missed[miss_entry[i]] = 1;
  }
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    if (i * kBlockThreads >= d.budget) break;  // block-uniform
    const int s = tid + i * kBlockThreads;
    const int slot = s >= d.budget ? -1 : (listed ? list_entry[i] : (list_entry[i] >= 0 ? s : -1));
    const bool hit = slot >= 0 && missed[slot] == 0;
    const unsigned ballot = __ballot_sync(0xFFFFFFFFU, hit);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = total;
#pragma unroll
    for (int w = 0; w < kBlockThreads / 32; ++w) {
      before += w < warp ? warp_counts[w] : 0;
      total += warp_counts[w];
    }
    if (hit) hit_slots[before + __popc(ballot & ((1U << lane) - 1U))] = slot;
    __syncthreads();  // warp_counts is rewritten next round; hit_slots is complete after the last
  }
  return total;
}

/// The row walk of KV head h of `view` for split `split` of `splits`; called by every thread of a block of
/// kBlockThreads threads (it ends with a barrier). The cache part is a list of k entries, each C rows or an empty
/// (masked) entry. K == k: entry s is buffer slot s (cache_chunks, -1 where empty), so every filled slot is read.
/// K > k: the slots hold chunks that are not selected now, so entry e is slot selected_slots[e] (the selection's
/// slots, ascending; -1 padding at the end). The cache part ends after the last filled entry. The list is copied to
/// `shared_slots` (kSharedSlotEntries ints) on the way when it fits, so that the steps' row lookups are not global
/// loads; `warp_last_filled`: kBlockThreads / 32 ints of shared memory.
// With `misses` (a fused step; kListed, the list in shared memory): the cache part is the slots this step did not
// miss (compact_hit_slots; `missed`: its flags), and the split's share is taken of those rows.
template <typename T, int D, bool kListed, int kBlockThreads>
__device__ __forceinline__ row_walk<T, D, kListed> begin_row_walk(const dims& d, const layer_view& view, int h,
                                                                 int split, int splits, int* shared_slots,
                                                                 int* warp_last_filled, const miss_lists& misses = {},
                                                                 long long pair = 0, unsigned char* missed = nullptr) {
  const int* global_slot_list =
      (kListed ? view.selected_slots : view.cache_chunks) + static_cast<long long>(h) * d.budget;
  const bool list_in_shared = d.budget <= kSharedSlotEntries;
  // The view's fields that the walk and its copies need, read before the slot list: their round trip overlaps the
  // list's instead of following its barrier (after it, a field read here took ~1 µs before a step's first copy).
  row_walk<T, D, kListed> walk{};
  walk.outlier_rows = view.outlier_chunks * d.chunk;
  walk.local_rows = view.local_len;
  walk.generated_rows = view.generated_exact_len;
  walk.ring_head = view.ring_head;
  const void* outlier_keys = view.outlier_keys;
  const void* outlier_values = view.outlier_values;
  const void* exact_keys = view.exact_keys;
  const void* exact_values = view.exact_values;
  const void* cache_keys = view.cache_keys;
  const void* cache_values = view.cache_values;
  int last_filled = -1;
  const bool hits_only = kListed && misses.counts != nullptr;
  if (hits_only) {
    last_filled =
        compact_hit_slots<kBlockThreads>(d, view, h, pair, misses, shared_slots, missed, warp_last_filled) - 1;
  } else {
    for (int s = static_cast<int>(threadIdx.x); s < d.budget; s += kBlockThreads) {
      const int entry = global_slot_list[s];
      if (list_in_shared) shared_slots[s] = entry;
      if (entry >= 0) last_filled = s;
    }
    last_filled = __reduce_max_sync(0xFFFFFFFFU, last_filled);
    if (threadIdx.x % 32 == 0) warp_last_filled[threadIdx.x / 32] = last_filled;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kBlockThreads / 32; ++w) last_filled = max(last_filled, warp_last_filled[w]);
  }

  walk.slot_list = list_in_shared || hits_only ? shared_slots : global_slot_list;
  walk.chunk = d.chunk;
  walk.chunk_shift = (d.chunk & (d.chunk - 1)) == 0 ? __ffs(d.chunk) - 1 : -1;  // C is normally a power of two
  walk.local_capacity = d.local_capacity;
  walk.window = d.window;
  const int total_rows = walk.outlier_rows + walk.local_rows + walk.generated_rows + (last_filled + 1) * d.chunk;
  const int span = (total_rows + splits - 1) / splits;
  walk.row_begin = min(total_rows, split * span);
  walk.row_end = min(total_rows, walk.row_begin + span);
  // Head h's arrays (elements): outliers [O*C, D], exact rows [local_capacity + W, D], cache rows [K*C, D].
  const long long outlier_offset = static_cast<long long>(h) * d.max_outliers * d.chunk * D;
  const long long exact_offset = static_cast<long long>(h) * (d.local_capacity + d.window) * D;
  const long long cache_offset = static_cast<long long>(h) * (kListed ? d.cache_slots : d.budget) * d.chunk * D;
  walk.outlier_keys = static_cast<const T*>(outlier_keys) + outlier_offset;
  walk.outlier_values = static_cast<const T*>(outlier_values) + outlier_offset;
  walk.exact_keys = static_cast<const T*>(exact_keys) + exact_offset;
  walk.exact_values = static_cast<const T*>(exact_values) + exact_offset;
  walk.cache_keys = static_cast<const T*>(cache_keys) + cache_offset;
  walk.cache_values = static_cast<const T*>(cache_values) + cache_offset;
  return walk;
}

/// exp2(x - m) for a merge weight; 0 when m is -inf (then x is -inf too: nothing was seen).
__device__ __forceinline__ float merge_weight(float x, float m) { return m == -INFINITY ? 0.0F : exp2f(x - m); }

// ---- The merge of one query head's split partials (the combine kernel) -------------------------------------------
// source: partial[b, j, 0 .. splits) of D + 2 floats each (an entry is 8-byte aligned: (max, sum) and the accumulator's
// element pairs load as float2). Loads bypass L1 (__ldcg): the partials were written by other CTAs.

/// The splits' weights 2^(max_s - max) into weights[0, splits) and 1 / sum_s w_s l_s into *inverse_total. Called by
/// the 32 lanes of one warp; each loads the (max, sum) pairs of its kMaxSplits / 32 splits at once.
__device__ __forceinline__ void split_weights_warp(const float* source, int splits, long long entry, float* weights,
                                                   float* inverse_total) {
  constexpr int kPerLane = kMaxSplits / 32;
  static_assert(kMaxSplits % 32 == 0, "whole splits a lane");
  const int lane = static_cast<int>(threadIdx.x % 32);
  float2 stats[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int s = lane + 32 * i;
    stats[i] = s < splits ? __ldcg(reinterpret_cast<const float2*>(source + s * entry)) : make_float2(-INFINITY, 0.0F);
  }
  float global_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) global_max = fmaxf(global_max, stats[i].x);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    global_max = fmaxf(global_max, __shfl_xor_sync(0xFFFFFFFFU, global_max, offset));
  }
  float total = 0.0F;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int s = lane + 32 * i;
    if (s < splits) {
      const float weight = merge_weight(stats[i].x, global_max);
      weights[s] = weight;
      total += weight * stats[i].y;
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xFFFFFFFFU, total, offset);
  // A NaN anywhere in the head's rows (a non-finite q, key or value the caller chose not to check) makes its
  // partial sum NaN, and that NaN reaches the output as on the CPU backend: the splits' weights alone would drop it
  // (a split whose scores are all NaN keeps max = -inf and so weight 0). No rows at all (total 0) give zeros.
  if (lane == 0) *inverse_total = total > 0.0F ? 1.0F / total : (total == total ? 0.0F : total);
}

// At most 170 registers: 3 CTAs (12 warps) per SM. kListed: the cache is larger than the budget (K > k) and its part
// of the row list goes through selected_slots; a template parameter, so that the default cache (K == k) compiles to
// the code it had before larger caches existed.
template <typename T, int D, int HeadTile, bool kListed>
__global__ void __launch_bounds__(kThreads, 3)
    sparse_attention_split_kernel(dims d, const layer_view* views, const int* batch_slots, int layer, strided_tensor q,
                                  float* partial, int splits, int max_splits) {
  wait_for_prior_grids();  // common/dependent_launch.cuh: nothing before the previous kernel is done
  using layout = cta_layout<T, D, HeadTile>;
  constexpr int kLanes = layout::lanes;
  constexpr int kPerLane = layout::per_lane;
  constexpr int kVec = layout::vec;
  constexpr int kElements = layout::elements;
  constexpr int kHeads = layout::heads_per_lane;
  constexpr int kParts = layout::head_parts;
  constexpr int kGroups = layout::groups;
  constexpr int kRows = layout::rows_per_group;
  constexpr int kStepRows = layout::step_rows;
  constexpr int kStages = layout::stages;

  // Pipeline stages [stage][K|V][step row][D] of T; after the row loop the same bytes hold the reduction.
  // layout::shared_bytes of dynamic shared memory: one instantiation (fp32, D = 256, HeadTile 4) needs 64 KiB, over
  // the 48 KiB that static shared memory may take on every target but sm_90a.
  extern __shared__ __align__(16) unsigned char storage[];
  __shared__ int warp_last_filled[kWarps];
  __shared__ int shared_slots[kSharedSlotEntries];  // the slot list, when d.budget entries fit
  __shared__ unsigned char row_is_token[kStages][kStepRows];  // written with the copies, read by the consumers
  T* const stage_rows = reinterpret_cast<T*>(storage);
  auto stage_row = [&](int stage, int which, int row) {
    return stage_rows + ((static_cast<long long>(stage) * 2 + which) * kStepRows + row) * D;
  };
  float (*const unit_acc)[HeadTile][D] = reinterpret_cast<float (*)[HeadTile][D]>(storage);
  float (*const unit_max)[HeadTile] =
      reinterpret_cast<float (*)[HeadTile]>(storage + layout::units * HeadTile * D * sizeof(float));
  float (*const unit_sum)[HeadTile] =
      reinterpret_cast<float (*)[HeadTile]>(storage + layout::units * HeadTile * (D + 1) * sizeof(float));

  const int split = static_cast<int>(blockIdx.x);
  const int h = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int row_slot = static_cast<int>(threadIdx.x) / kLanes;
  const int part = row_slot % kParts;   // which heads_per_lane query heads of the tile
  const int group = row_slot / kParts;  // which rows
  const int segment = lane % kLanes;    // which vectors of a row

  const layer_view& view = views[static_cast<long long>(batch_slots[b]) * d.num_layers + layer];
  const row_walk<T, D, kListed> walk =
      begin_row_walk<T, D, kListed, kThreads>(d, view, h, split, splits, shared_slots, warp_last_filled);
  const int row_begin = walk.row_begin;
  const int steps = (walk.row_end - row_begin + kStepRows - 1) / kStepRows;

  // Starts the copies of step `step` into its stage (rows spread over all row slots) and commits them as one group
  // (an empty group past the last step keeps the group count uniform).
  auto issue_step = [&](int step) {
    if (step < steps) {
      const int stage = step % kStages;
      const int base = row_begin + step * kStepRows;
      for (int r = row_slot; r < kStepRows; r += layout::slots) {
        const bool token = walk.valid(base + r);
        if (segment == 0) row_is_token[stage][r] = token ? 1 : 0;
        if (!token) continue;
        const T* key = nullptr;
        const T* value = nullptr;
        walk.locate(base + r, key, value);
#pragma unroll
        for (int v = 0; v < kPerLane; ++v) {
          const int vector = segment + v * kLanes;
          if (vector < layout::vectors) {
            copy_async<16>(stage_row(stage, 0, r) + vector * kVec, key + vector * kVec);  // L2 only: rows read once
            copy_async<16>(stage_row(stage, 1, r) + vector * kVec, value + vector * kVec);
          }
        }
      }
    }
    commit_async_copies();
  };

  const float q_scale = d.softmax_scale * kLog2e;
  const int tiles = (d.group + HeadTile - 1) / HeadTile;
  for (int tile = 0; tile < tiles; ++tile) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) issue_step(s);

    const int first_head = tile * HeadTile + part * kHeads;  // within the group
    // This lane's slice of its query heads, scaled so that scores are in log2 units.
    float query[kHeads][kElements];
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      const int local_head = first_head + g;
      const long long head_offset = static_cast<long long>(b) * q.stride[0] +
                                    static_cast<long long>(h * d.group + local_head) * q.stride[1];
#pragma unroll
      for (int v = 0; v < kPerLane; ++v) {
        const int vector = segment + v * kLanes;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const bool used = local_head < d.group && vector < layout::vectors;
          const long long offset = head_offset + static_cast<long long>(vector * kVec + e) * q.stride[2];
          query[g][v * kVec + e] = used ? q_scale * load_any(q.data, q.type, offset) : 0.0F;
        }
      }
    }

    float running_max[kHeads];
    float running_sum[kHeads];
    float acc[kHeads][kElements];
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
      running_max[g] = -INFINITY;
      running_sum[g] = 0.0F;
#pragma unroll
      for (int e = 0; e < kElements; ++e) acc[g][e] = 0.0F;
    }

    for (int step = 0; step < steps; ++step) {
      wait_async_copies<kStages - 2>();  // this thread's copies of `step` have landed ...
      __syncthreads();                 // ... everyone's have, and nobody still reads the stage refilled next
      issue_step(step + kStages - 1);

      const int stage = step % kStages;
      uint4 key_raw[kRows][kPerLane];
      uint4 value_raw[kRows][kPerLane];
      bool valid[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int r = u * kGroups + group;
        valid[u] = row_is_token[stage][r] != 0;
#pragma unroll
        for (int v = 0; v < kPerLane; ++v) {
          const int vector = segment + v * kLanes;
          key_raw[u][v] = make_uint4(0, 0, 0, 0);  // rows outside the token set hold stale bytes: never read them
          value_raw[u][v] = make_uint4(0, 0, 0, 0);
          if (valid[u] && vector < layout::vectors) {
            key_raw[u][v] = *reinterpret_cast<const uint4*>(stage_row(stage, 0, r) + vector * kVec);
            value_raw[u][v] = *reinterpret_cast<const uint4*>(stage_row(stage, 1, r) + vector * kVec);
          }
        }
      }

      float score[kHeads][kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        float key_row[kElements];
#pragma unroll
        for (int v = 0; v < kPerLane; ++v) vector16<T>::to_floats(key_raw[u][v], key_row + v * kVec);
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
          float dot = 0.0F;
#pragma unroll
          for (int e = 0; e < kElements; ++e) dot = fmaf(query[g][e], key_row[e], dot);
          score[g][u] = dot;
        }
      }
#pragma unroll
      for (int offset = kLanes / 2; offset > 0; offset /= 2) {
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
#pragma unroll
          for (int u = 0; u < kRows; ++u) score[g][u] += __shfl_xor_sync(0xFFFFFFFFU, score[g][u], offset);
        }
      }

      // Online softmax: p = 2^(score - max); rows outside the token set get p = 0 (their registers hold zeros).
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        float step_max = running_max[g];
#pragma unroll
        for (int u = 0; u < kRows; ++u) step_max = valid[u] ? fmaxf(step_max, score[g][u]) : step_max;
        const float rescale = step_max == -INFINITY ? 1.0F : exp2f(running_max[g] - step_max);
        float step_sum = 0.0F;
#pragma unroll
        for (int u = 0; u < kRows; ++u) {
          score[g][u] = valid[u] ? exp2f(score[g][u] - step_max) : 0.0F;  // now the probability
          step_sum += score[g][u];
        }
        running_sum[g] = running_sum[g] * rescale + step_sum;
        running_max[g] = step_max;
#pragma unroll
        for (int e = 0; e < kElements; ++e) acc[g][e] *= rescale;
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        float value_row[kElements];
#pragma unroll
        for (int v = 0; v < kPerLane; ++v) vector16<T>::to_floats(value_raw[u][v], value_row + v * kVec);
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
#pragma unroll
          for (int e = 0; e < kElements; ++e) acc[g][e] = fmaf(score[g][u], value_row[e], acc[g][e]);
        }
      }
    }
    wait_async_copies<0>();  // only empty groups can be left; the stages become the reduction buffer
    __syncthreads();

    // Merge the row groups of a warp that hold the same heads (a butterfly: all of them end with the merged state) ...
#pragma unroll
    for (int offset = kLanes * kParts; offset < 32; offset *= 2) {
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        const float other_max = __shfl_xor_sync(0xFFFFFFFFU, running_max[g], offset);
        const float other_sum = __shfl_xor_sync(0xFFFFFFFFU, running_sum[g], offset);
        const float merged_max = fmaxf(running_max[g], other_max);
        const float mine = merge_weight(running_max[g], merged_max);
        const float theirs = merge_weight(other_max, merged_max);
        running_sum[g] = running_sum[g] * mine + other_sum * theirs;
        running_max[g] = merged_max;
#pragma unroll
        for (int e = 0; e < kElements; ++e) {
          const float other = __shfl_xor_sync(0xFFFFFFFFU, acc[g][e], offset);
          acc[g][e] = acc[g][e] * mine + other * theirs;
        }
      }
    }
    // ... then the warps (pairs of warps when they split the heads) through shared memory.
    const int unit = warp / layout::warps_per_group;
    if (lane < kLanes * layout::parts_in_warp) {
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        const int tile_head = part * kHeads + g;
#pragma unroll
        for (int v = 0; v < kPerLane; ++v) {
          const int vector = segment + v * kLanes;
          if (vector < layout::vectors) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) unit_acc[unit][tile_head][vector * kVec + e] = acc[g][v * kVec + e];
          }
        }
        if (segment == 0) {
          unit_max[unit][tile_head] = running_max[g];
          unit_sum[unit][tile_head] = running_sum[g];
        }
      }
    }
    __syncthreads();
    for (int index = static_cast<int>(threadIdx.x); index < HeadTile * D; index += kThreads) {
      const int tile_head = index / D;
      const int dim = index % D;
      const int local_head = tile * HeadTile + tile_head;
      if (local_head >= d.group) continue;
      float cta_max = -INFINITY;
#pragma unroll
      for (int w = 0; w < layout::units; ++w) cta_max = fmaxf(cta_max, unit_max[w][tile_head]);
      float sum = 0.0F;
      float value = 0.0F;
#pragma unroll
      for (int w = 0; w < layout::units; ++w) {
        const float weight = merge_weight(unit_max[w][tile_head], cta_max);
        sum += weight * unit_sum[w][tile_head];
        value += weight * unit_acc[w][tile_head][dim];
      }
      const long long j = static_cast<long long>(h) * d.group + local_head;
      float* out = partial + ((static_cast<long long>(b) * d.q_heads + j) * max_splits + split) * (D + 2);
      out[2 + dim] = value;
      if (dim == 0) {
        out[0] = cta_max;
        out[1] = sum;
      }
    }
    __syncthreads();  // the next tile refills the stages
  }
}

// ---- The tensor-core split kernel (bf16 keys and values, D <= 128) -----------------------------------------------
//
// Same grid, row walk and partial output as sparse_attention_split_kernel; the arithmetic on tensor cores. A CTA of 4
// warps takes steps of kMmaStepRows = 64 rows (K and V rows in shared memory, rows padded by 16 bytes so that
// ldmatrix reads are free of bank conflicts; 2 stages of cp.async); warp w takes rows 16w .. 16w + 15 of a step. For
// a tile of up to 16 query heads (the MMA's M; heads past the group are zero rows):
//   S[16 heads x 16 rows] = Q K^T   with mma.sync m16n8k16 (bf16 in, fp32 accumulate), Q split into three bf16 terms
//                                   (hi + mid + lo = the fp32 query exactly), K exact in bf16;
//   online softmax over the rows in log2 units, as the FMA kernel (rows that are not tokens: -inf, and their K and V
//   rows zero-filled in shared memory, so that 0 x stale bytes cannot make a NaN);
//   O[16 heads x D] += P V          P split into three bf16 terms the same way, V exact.
// So every product is exact and only the fp32 accumulation order differs from the FMA kernel. The warps' states merge
// through shared memory at the end, as in the FMA kernel. ~100 tensor-core and ~150 other instructions a warp per 16
// rows, where the FMA kernel issues ~1400 (docs/performance.md; session 10).
constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kMmaStepRows = 16 * kMmaWarps;
constexpr int kMmaStages = 2;
constexpr int kMmaHeads = 16;  ///< query heads of a tile: the MMA's M
constexpr int kMmaTerms = kBf16Terms;  ///< bf16 terms of a float32 operand (common/bf16_mma.cuh)
/// CTAs the split count aims for with the tensor-core kernel: one wave at 2 CTAs per SM of an H200.
constexpr int kMmaTargetCtas = 132 * 2;

template <int D>
struct mma_layout {
  static constexpr int row_elements = D + 8;  ///< a shared row: D bf16 and 16 bytes of padding
  static constexpr int row_bytes = row_elements * 2;
  static constexpr int stage_bytes = 2 * kMmaStepRows * row_bytes;             ///< K and V rows of one step
  static constexpr int query_bytes = kMmaTerms * kMmaHeads * row_bytes;        ///< Q's three terms
  static constexpr int reduction_bytes = kMmaWarps * kMmaHeads * (D + 2) * 4;  ///< the warps' states, float32
  static constexpr int pipeline_bytes = kMmaStages * stage_bytes;
  static constexpr int query_offset = std::max(pipeline_bytes, reduction_bytes);
  static constexpr int shared_bytes = query_offset + query_bytes;  ///< dynamic
  static constexpr int vectors = D * 2 / 16;                       ///< 16-byte vectors of a row
  static constexpr int lanes = next_power_of_two(vectors) < 32 ? next_power_of_two(vectors) : 32;  ///< per row
  static constexpr int row_slots = kMmaThreads / lanes;
  static_assert(D % 16 == 0 && D <= 128, "the tensor-core kernel takes D <= 128, a multiple of 16");
  static_assert(vectors <= lanes, "one 16-byte vector a lane");
};

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void load_matrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

__device__ __forceinline__ void load_matrix_x4_transposed(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
}

// With `misses` (a fused step, kListed): the hit rows only, and no wait for the key rebuild before them (it writes
// only the missed slots' keys, and their partials); the wait comes last, so that the combine after this kernel finds
// the rebuild's partials written.
template <int D, bool kListed>
__global__ void __launch_bounds__(kMmaThreads, 2)
    sparse_attention_mma_kernel(dims d, const layer_view* views, const int* batch_slots, int layer, strided_tensor q,
                                float* partial, int splits, int max_splits, miss_lists misses) {
  start_phase_stamps(stamped_kernel::attention);
  const bool fused = kListed && misses.counts != nullptr;
  // dims::attention_early: the row walk (the views, the selection's slot list) and q come before the wait: nothing the
  // key rebuild (the kernel before this one) writes is read until the first step's copies, issued after it.
  if (d.attention_early == 0 && !fused) wait_for_prior_grids();  // common/dependent_launch.cuh
  phase_stamp(stamped_kernel::attention, 1);
  using T = __nv_bfloat16;
  using layout = mma_layout<D>;
  constexpr int kRow = layout::row_elements;
  constexpr int kLanes = layout::lanes;
  extern __shared__ __align__(16) unsigned char storage[];
  __shared__ int warp_last_filled[kMmaWarps];
  __shared__ int shared_slots[kSharedSlotEntries];
  __shared__ unsigned char row_is_token[kMmaStages][kMmaStepRows];
  __shared__ unsigned char missed[kListed ? kSharedSlotEntries : 1];  // a fused step's flags (compact_hit_slots)
  T* const stage_rows = reinterpret_cast<T*>(storage);
  auto stage_row = [&](int stage, int which, int row) {
    return stage_rows + ((stage * 2 + which) * kMmaStepRows + row) * kRow;
  };
  T* const query_rows = reinterpret_cast<T*>(storage + layout::query_offset);
  float (*const unit_acc)[kMmaHeads][D] = reinterpret_cast<float (*)[kMmaHeads][D]>(storage);
  float (*const unit_max)[kMmaHeads] =
      reinterpret_cast<float (*)[kMmaHeads]>(storage + kMmaWarps * kMmaHeads * D * sizeof(float));
  float (*const unit_sum)[kMmaHeads] =
      reinterpret_cast<float (*)[kMmaHeads]>(storage + kMmaWarps * kMmaHeads * (D + 1) * sizeof(float));

  const int split = static_cast<int>(blockIdx.x);
  const int h = static_cast<int>(blockIdx.y);
  const int b = static_cast<int>(blockIdx.z);
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int row_slot = tid / kLanes;
  const int segment = tid % kLanes;

  const layer_view& view = views[static_cast<long long>(batch_slots[b]) * d.num_layers + layer];
  const row_walk<T, D, kListed> walk = begin_row_walk<T, D, kListed, kMmaThreads>(
      d, view, h, split, splits, shared_slots, warp_last_filled, misses,
      static_cast<long long>(b) * d.kv_heads + h, missed);
  phase_stamp(stamped_kernel::attention, 60);
  const int row_begin = walk.row_begin;
  const int steps = (walk.row_end - row_begin + kMmaStepRows - 1) / kMmaStepRows;

  // Copies of step `step` into its stage, one 16-byte vector of K and one of V a lane; rows that are not tokens are
  // zero-filled. Committed as one group (an empty group past the last step keeps the group count uniform).
  auto issue_step = [&](int step) {
    if (step < steps) {
      const int stage = step % kMmaStages;
      const int base = row_begin + step * kMmaStepRows;
      for (int r = row_slot; r < kMmaStepRows; r += layout::row_slots) {
        const bool token = walk.valid(base + r);
        if (segment == 0) row_is_token[stage][r] = token ? 1 : 0;
        if (segment >= layout::vectors) continue;
        T* key_row = stage_row(stage, 0, r) + segment * 8;
        T* value_row = stage_row(stage, 1, r) + segment * 8;
        if (token) {
          const T* key = nullptr;
          const T* value = nullptr;
          walk.locate(base + r, key, value);
          copy_async<16>(key_row, key + segment * 8);
          copy_async<16>(value_row, value + segment * 8);
        } else {
          *reinterpret_cast<uint4*>(key_row) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(value_row) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    commit_async_copies();
  };

  const float q_scale = d.softmax_scale * kLog2e;
  const int group_row = lane / 4;       // the C fragment's row (query head) of this lane, and that + 8
  const int pair_col = 2 * (lane % 4);  // the C fragment's first column of this lane
  const int tiles = (d.group + kMmaHeads - 1) / kMmaHeads;
  for (int tile = 0; tile < tiles; ++tile) {
    // Q's three bf16 terms, [term][head][kRow], scaled so that scores are in log2 units; heads past the group: 0.
    for (int index = tid; index < kMmaHeads * D / 2; index += kMmaThreads) {
      const int head = index / (D / 2);
      const int dim = 2 * (index % (D / 2));
      const int local_head = tile * kMmaHeads + head;
      float x[2] = {0.0F, 0.0F};
      if (local_head < d.group) {
        const long long head_offset = static_cast<long long>(b) * q.stride[0] +
                                      static_cast<long long>(h * d.group + local_head) * q.stride[1];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          x[e] = q_scale * load_any(q.data, q.type, head_offset + static_cast<long long>(dim + e) * q.stride[2]);
        }
      }
      unsigned terms[kMmaTerms];
      split_bf16x2(x[0], x[1], terms);
#pragma unroll
      for (int t = 0; t < kMmaTerms; ++t) {
        *reinterpret_cast<unsigned*>(query_rows + (t * kMmaHeads + head) * kRow + dim) = terms[t];
      }
    }
    if (tile == 0 && !fused) wait_for_prior_grids();  // (returns at once when it already waited above)
#pragma unroll
    for (int s = 0; s < kMmaStages - 1; ++s) issue_step(s);
    phase_stamp(stamped_kernel::attention, 61);

    float running_max[2] = {-INFINITY, -INFINITY};  // heads group_row and group_row + 8
    float running_sum[2] = {0.0F, 0.0F};             // this lane's columns only; summed over the quad at the end
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = 0.0F;
    }

    for (int step = 0; step < steps; ++step) {
      wait_async_copies<kMmaStages - 2>();
      __syncthreads();  // everyone's copies have landed (and Q is written), nobody still reads the stage refilled next
      phase_stamp(stamped_kernel::attention, 62);
      issue_step(step + kMmaStages - 1);
      if (step < 8) phase_stamp(stamped_kernel::attention, 63);
      const int stage = step % kMmaStages;
      const int first_row = warp * 16;
      const int matrix = lane / 8;  // which 8x8 matrix of an ldmatrix.x4 this lane gives the row address of

      // S = Q K^T over this warp's 16 rows: two n-tiles of 8 rows.
      float score[2][4] = {{0.0F, 0.0F, 0.0F, 0.0F}, {0.0F, 0.0F, 0.0F, 0.0F}};
#pragma unroll
      for (int k0 = 0; k0 < D; k0 += 16) {
        unsigned key_frag[4];  // n-tile 0: [0], [1]; n-tile 1: [2], [3]
        load_matrix_x4(key_frag, stage_row(stage, 0, first_row + (matrix >> 1) * 8 + lane % 8) + k0 + (matrix & 1) * 8);
#pragma unroll
        for (int t = 0; t < kMmaTerms; ++t) {
          unsigned query_frag[4];
          load_matrix_x4(query_frag,
                         query_rows + (t * kMmaHeads + (matrix & 1) * 8 + lane % 8) * kRow + k0 + (matrix >> 1) * 8);
          mma_bf16(score[0], query_frag, key_frag[0], key_frag[1]);
          mma_bf16(score[1], query_frag, key_frag[2], key_frag[3]);
        }
      }

      // Online softmax of heads group_row (elements 0, 1) and group_row + 8 (elements 2, 3); the four lanes of a quad
      // hold the 16 rows' columns of the same heads.
      bool valid[2][2];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) valid[n][e] = row_is_token[stage][first_row + 8 * n + pair_col + e] != 0;
      }
      float rescale[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float step_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) step_max = valid[n][e] ? fmaxf(step_max, score[n][2 * half + e]) : step_max;
        }
        step_max = fmaxf(step_max, __shfl_xor_sync(0xFFFFFFFFU, step_max, 1));
        step_max = fmaxf(step_max, __shfl_xor_sync(0xFFFFFFFFU, step_max, 2));
        const float new_max = fmaxf(running_max[half], step_max);
        rescale[half] = new_max == -INFINITY ? 1.0F : exp2f(running_max[half] - new_max);
        float step_sum = 0.0F;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& p = score[n][2 * half + e];
            p = valid[n][e] ? exp2f(p - new_max) : 0.0F;  // now the probability
            step_sum += p;
          }
        }
        running_sum[half] = running_sum[half] * rescale[half] + step_sum;
        running_max[half] = new_max;
      }
      if (rescale[0] != 1.0F || rescale[1] != 1.0F) {  // x 1 is exact: skipping it changes no bit
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[n][0] *= rescale[0];
          acc[n][1] *= rescale[0];
          acc[n][2] *= rescale[1];
          acc[n][3] *= rescale[1];
        }
      }

      // O += P V: P as the A operand (16 heads x 16 rows) straight from the score fragments, in three bf16 terms.
      unsigned p_frag[kMmaTerms][4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        unsigned terms[kMmaTerms];
        split_bf16x2(score[r >> 1][2 * (r & 1)], score[r >> 1][2 * (r & 1) + 1], terms);
#pragma unroll
        for (int t = 0; t < kMmaTerms; ++t) p_frag[t][r] = terms[t];
      }
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        unsigned value_frag[4];  // d n-tile n: [0], [1]; n + 1: [2], [3]
        load_matrix_x4_transposed(value_frag,
                                  stage_row(stage, 1, first_row + (matrix & 1) * 8 + lane % 8) + (n + (matrix >> 1)) * 8);
#pragma unroll
        for (int t = 0; t < kMmaTerms; ++t) {
          mma_bf16(acc[n], p_frag[t], value_frag[0], value_frag[1]);
          mma_bf16(acc[n + 1], p_frag[t], value_frag[2], value_frag[3]);
        }
      }
    }
    wait_async_copies<0>();  // only empty groups can be left; the stages become the reduction buffer
    __syncthreads();
    phase_stamp(stamped_kernel::attention, 64);

    // The quad's column sums, then each warp's state to shared memory, then the CTA's merge: of the tile's query heads
    // only (the MMA's rows past them are padding: 12 of 16 at a group of 4).
    const int tile_heads = min(kMmaHeads, d.group - tile * kMmaHeads);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      running_sum[half] += __shfl_xor_sync(0xFFFFFFFFU, running_sum[half], 1);
      running_sum[half] += __shfl_xor_sync(0xFFFFFFFFU, running_sum[half], 2);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (group_row + 8 * half < tile_heads) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) unit_acc[warp][group_row + 8 * half][8 * n + pair_col + e] = acc[n][2 * half + e];
        }
        if (lane % 4 == 0) {
          unit_max[warp][group_row + 8 * half] = running_max[half];
          unit_sum[warp][group_row + 8 * half] = running_sum[half];
        }
      }
    }
    __syncthreads();
    phase_stamp(stamped_kernel::attention, 65);
    for (int index = tid; index < tile_heads * D; index += kMmaThreads) {
      const int tile_head = index / D;
      const int dim = index % D;
      const int local_head = tile * kMmaHeads + tile_head;
      float cta_max = -INFINITY;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) cta_max = fmaxf(cta_max, unit_max[w][tile_head]);
      float sum = 0.0F;
      float value = 0.0F;
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) {
        const float weight = merge_weight(unit_max[w][tile_head], cta_max);
        sum += weight * unit_sum[w][tile_head];
        value += weight * unit_acc[w][tile_head][dim];
      }
      const long long j = static_cast<long long>(h) * d.group + local_head;
      float* out = partial + ((static_cast<long long>(b) * d.q_heads + j) * max_splits + split) * (D + 2);
      out[2 + dim] = value;
      if (dim == 0) {
        out[0] = cta_max;
        out[1] = sum;
      }
    }
    __syncthreads();  // the next tile refills the stages and Q
  }
  if (fused) wait_for_prior_grids();  // the key rebuild's partials are written when this grid ends
  finish_phase_stamps(stamped_kernel::attention, 69);
}

// One CTA a (query head j, entry b): out = sum_s w_s acc_s / sum_s w_s l_s over the head's partials. Thread t takes
// the output pair of dims 2p, 2p + 1, p = t % (D / 2), for part t / (D / 2) of the splits (kCombineThreads / (D / 2)
// parts, contiguous ranges; D = 128: two), and issues the loads of its first kCombineBatch accumulators before the
// splits' weights are known: the weights' round trip (warp 0) and the accumulators' overlap, where the weights were
// waited for first and the accumulators loaded then (5.1-5.5 µs at B = 1's 33 splits a head, docs/performance.md). The
// parts' sums meet in shared memory, added in part order. A split with weight 0 (no rows, or all scores NaN) is not
// added (its accumulator may be NaN).
// fused_counts (a fused step: the miss counts of the launch's part, [batch, Hkv]): query head j also merges the key
// rebuild's partials after the splits, ceil(misses / group_chunks) of them for its KV head j / group.
__global__ void __launch_bounds__(kCombineThreads)
    sparse_attention_combine_kernel(int head_dim, int q_heads, const float* partial, int splits, int max_splits,
                                    strided_tensor out, const int* fused_counts, int group, int group_chunks) {
  start_phase_stamps(stamped_kernel::combine);
  wait_for_prior_grids();  // common/dependent_launch.cuh: nothing before the previous kernel is done
  phase_stamp(stamped_kernel::combine, 1);
  __shared__ float weights[kMaxSplits];
  __shared__ float inverse_total;
  __shared__ float2 part_sums[kCombineThreads];
  const int j = static_cast<int>(blockIdx.x);
  const int b = static_cast<int>(blockIdx.y);
  if (fused_counts != nullptr) {
    const int misses = fused_counts[static_cast<long long>(b) * (q_heads / group) + j / group];
    splits += (misses + group_chunks - 1) / group_chunks;
  }
  const long long entry = static_cast<long long>(head_dim) + 2;
  const float* source = partial + (static_cast<long long>(b) * q_heads + j) * max_splits * entry;
  const int pairs = head_dim / 2;  // <= kCombineThreads (D <= 256)
  const int parts = max(1, min(kCombineThreads / pairs, splits));
  const int per_part = (splits + parts - 1) / parts;
  const int tid = static_cast<int>(threadIdx.x);
  const int part = tid / pairs;
  const int dim = 2 * (tid % pairs);
  const int first = part * per_part;
  const int end = part < parts ? min(splits, first + per_part) : first;
  float2 loaded[kCombineBatch];
#pragma unroll
  for (int i = 0; i < kCombineBatch; ++i) {
    const int s = first + i;
    loaded[i] =
        s < end ? __ldcg(reinterpret_cast<const float2*>(source + s * entry + 2 + dim)) : make_float2(0.0F, 0.0F);
  }
  if (tid < 32) split_weights_warp(source, splits, entry, weights, &inverse_total);
  __syncthreads();
  phase_stamp(stamped_kernel::combine, 70);
  float2 sum = make_float2(0.0F, 0.0F);
  for (int batch = first; batch < end; batch += kCombineBatch) {
    if (batch != first) {
#pragma unroll
      for (int i = 0; i < kCombineBatch; ++i) {
        const int s = batch + i;
        loaded[i] =
            s < end ? __ldcg(reinterpret_cast<const float2*>(source + s * entry + 2 + dim)) : make_float2(0.0F, 0.0F);
      }
    }
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      const int s = batch + i;
      if (s < end && weights[s] != 0.0F) {
        sum.x = fmaf(weights[s], loaded[i].x, sum.x);
        sum.y = fmaf(weights[s], loaded[i].y, sum.y);
      }
    }
  }
  part_sums[tid] = sum;
  __syncthreads();
  if (tid < pairs) {
    for (int p = 1; p < parts; ++p) {
      sum.x += part_sums[p * pairs + tid].x;
      sum.y += part_sums[p * pairs + tid].y;
    }
    void* target = const_cast<void*>(out.data);  // strided_tensor carries a const pointer; out is ours to write
    const long long head_offset =
        static_cast<long long>(b) * out.stride[0] + static_cast<long long>(j) * out.stride[1];
    store_any(target, out.type, head_offset + dim * out.stride[2], sum.x * inverse_total);
    store_any(target, out.type, head_offset + (dim + 1) * out.stride[2], sum.y * inverse_total);
  }
  finish_phase_stamps(stamped_kernel::combine, 71);
}

bool valid_element_type(int type) { return type == element_f32 || type == element_f16 || type == element_bf16; }

/// Whether the tensor-core kernel serves these dims and element type: bf16 keys and values, D <= 128 (its float32
/// accumulators of 16 heads x D stay in registers).
bool mma_kernel_serves(const dims& d, int kv_type) {
  return kv_type == element_bf16 && d.head_dim <= 128 && d.head_dim % 16 == 0;
}

int choose_splits(const dims& d, int batch, int max_splits, int target_ctas) {
  // Rounded down: the grid stays within one wave rather than spilling a partial second one.
  const long long heads = static_cast<long long>(batch) * d.kv_heads;
  const long long wanted = target_ctas / heads;
  const long long limit = std::min(sparse_attention_max_splits(d), max_splits);
  return static_cast<int>(std::max(1LL, std::min(wanted, limit)));
}

/// Arguments of one split-kernel launch.
struct split_launch {
  miss_lists misses;
  dims d;
  const layer_view* views;
  const int* batch_slots;
  int layer;
  int batch;
  strided_tensor q;
  float* partial;
  int splits;
  int max_splits;
  cudaStream_t stream;
};

template <int D, bool kListed>
void launch_mma_split(const split_launch& a) {
  using layout = mma_layout<D>;
  static std::atomic<std::uint64_t> allowed_on_devices{0};  // above 48 KiB: the opt-in limit, once per device
  shadowkv_allow_large_shared_memory(sparse_attention_mma_kernel<D, kListed>, allowed_on_devices);
  const dim3 grid(static_cast<unsigned>(a.splits), static_cast<unsigned>(a.d.kv_heads), static_cast<unsigned>(a.batch));
  launch_after_prior_grid(sparse_attention_mma_kernel<D, kListed>, grid, dim3(kMmaThreads), layout::shared_bytes,
                          a.stream, true, a.d, a.views, a.batch_slots, a.layer, a.q, a.partial,
                          a.splits, a.max_splits, a.misses);
}

template <typename T, int D, int HeadTile, bool kListed>
void launch_split(const split_launch& a) {
  using layout = cta_layout<T, D, HeadTile>;
  if constexpr (layout::shared_bytes + layout::static_bytes > kDefaultSharedBytes) {
    static std::atomic<std::uint64_t> allowed_on_devices{0};
    shadowkv_allow_large_shared_memory(sparse_attention_split_kernel<T, D, HeadTile, kListed>, allowed_on_devices);
  }
  const dim3 grid(static_cast<unsigned>(a.splits), static_cast<unsigned>(a.d.kv_heads), static_cast<unsigned>(a.batch));
  launch_after_prior_grid(sparse_attention_split_kernel<T, D, HeadTile, kListed>, grid, dim3(kThreads),
                          layout::shared_bytes, a.stream, true, a.d, a.views, a.batch_slots,
                          a.layer, a.q, a.partial, a.splits, a.max_splits);
}

}  // namespace

int sparse_attention_max_splits(const dims& d) {
  const long long chunk = std::max(d.chunk, 0);
  const long long rows = std::max(d.max_outliers, 0) * chunk + std::max(d.local_capacity, 0) +
                         std::max(d.window, 0) + std::max(d.budget, 0) * chunk;
  const long long by_rows = (rows + kMinRowsPerSplit - 1) / kMinRowsPerSplit;
  return static_cast<int>(std::clamp<long long>(by_rows, 1, kMaxAttentionSplits));
}

bool sparse_attention_fuses(const dims& d, int kv_type, int max_splits) {
  return mma_kernel_serves(d, kv_type) && d.value_fp8 == 0 && d.group >= 1 && d.group <= kMissAttentionMaxGroup &&
         d.budget <= kSharedSlotEntries && d.cache_slots <= kSharedSlotEntries && max_splits <= kMaxSplits &&
         max_splits - rebuild_max_groups(d) >= 1;
}

int sparse_attention_partials(const dims& d, int kv_type) {
  const int splits = sparse_attention_max_splits(d);
  const int with_groups = std::min(kMaxSplits, splits + rebuild_max_groups(d));
  return sparse_attention_fuses(d, kv_type, with_groups) ? with_groups : splits;
}

int sparse_attention_splits(const dims& d, int kv_type, int batch, int max_splits) {
  const bool tensor_cores = mma_kernel_serves(d, kv_type);
  if (d.fused_misses != 0) {
    // The key rebuild's partials follow the splits (rebuild_max_groups of them at most).
    return choose_splits(d, batch, max_splits - rebuild_max_groups(d), kFusedTargetCtas);
  }
  return choose_splits(d, batch, max_splits, tensor_cores ? kMmaTargetCtas : kTargetCtas);
}

void launch_sparse_attention(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                             int batch, strided_tensor q, strided_tensor out, float* partial, int max_splits,
                             cudaStream_t stream, cudaEvent_t splits_done, const int* miss_slots,
                             const int* miss_counts) {
  SHADOWKV_EXPECTS(supported_head_dim(d.head_dim), "sparse attention supports head_dim 64, 80, 96, 128 or 256, got ",
                   d.head_dim);
  SHADOWKV_EXPECTS(d.kv_heads >= 1 && d.kv_heads <= 65535 && d.group >= 1 && d.q_heads == d.kv_heads * d.group,
                   "sparse attention: need 1 <= kv_heads <= 65535, group >= 1 and q_heads == kv_heads * group, got "
                   "q_heads ",
                   d.q_heads, ", kv_heads ", d.kv_heads, ", group ", d.group);
  SHADOWKV_EXPECTS(d.chunk >= 1 && d.budget >= 0 && d.cache_slots >= d.budget && d.max_outliers >= 0 &&
                       d.local_capacity >= 0 && d.window >= 0,
                   "sparse attention: invalid dims: chunk ", d.chunk, ", budget ", d.budget, ", cache_slots ",
                   d.cache_slots, ", max_outliers ", d.max_outliers, ", local_capacity ", d.local_capacity,
                   ", window ", d.window);
  SHADOWKV_EXPECTS(layer >= 0 && layer < d.num_layers, "sparse attention: layer ", layer, " not in [0, ",
                   d.num_layers, ")");
  SHADOWKV_EXPECTS(valid_element_type(kv_type) && valid_element_type(q.type) && valid_element_type(out.type),
                   "sparse attention: unknown element type code (kv ", kv_type, ", q ", q.type, ", out ", out.type,
                   ")");
  SHADOWKV_EXPECTS(batch >= 0 && batch <= 65535, "sparse attention: batch ", batch, " not in [0, 65535]");
  SHADOWKV_EXPECTS(max_splits >= 1, "sparse attention: max_splits must be >= 1, got ", max_splits);
  if (batch == 0) {
    if (splits_done != nullptr) SHADOWKV_CUDA_TRY(cudaEventRecord(splits_done, stream));
    return;
  }
  SHADOWKV_EXPECTS(views != nullptr && batch_slots != nullptr && partial != nullptr && q.data != nullptr &&
                       out.data != nullptr,
                   "sparse attention: null views, batch_slots, partial, q or out");

  const bool tensor_cores = mma_kernel_serves(d, kv_type);
  const bool fused = d.fused_misses != 0;
  if (fused) {
    SHADOWKV_EXPECTS(sparse_attention_fuses(d, kv_type, max_splits) && miss_slots != nullptr && miss_counts != nullptr,
                     "sparse attention: a fused step needs the tensor-core kernel's shapes (bf16, head_dim <= 128), "
                     "bf16 values, 1 to ", kMissAttentionMaxGroup, " query heads per KV head, k and K <= ",
                     kSharedSlotEntries, ", room for the key rebuild's ", rebuild_max_groups(d), " partials in ",
                     max_splits, " (at most ", kMaxSplits, "), and the miss lists");
  }
  const int splits = sparse_attention_splits(d, kv_type, batch, max_splits);
  miss_lists misses;
  if (fused) {
    misses.slots = miss_slots;
    misses.counts = miss_counts;
  }
  const split_launch launch{misses, d, views, batch_slots, layer, batch, q, partial, splits, max_splits, stream};
  shadowkv_dispatch_element(kv_type, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    shadowkv_dispatch_head_dim(d.head_dim, "sparse attention", [&](auto head_dim) {
      constexpr int kD = decltype(head_dim)::value;
      if constexpr (std::is_same_v<T, __nv_bfloat16> && kD <= 128) {
        if (tensor_cores) {
          if (d.cache_slots > d.budget || fused) {
            launch_mma_split<kD, true>(launch);
          } else {
            launch_mma_split<kD, false>(launch);
          }
          return;
        }
      }
      // Query-head tile: larger groups loop over tiles.
      shadowkv_dispatch_head_tile(d.group, [&](auto head_tile) {
        constexpr int kTile = decltype(head_tile)::value;
        if (d.cache_slots > d.budget) {
          launch_split<T, kD, kTile, true>(launch);
        } else {
          launch_split<T, kD, kTile, false>(launch);
        }
      });
    });
  });
  if (splits_done != nullptr) SHADOWKV_CUDA_TRY(cudaEventRecord(splits_done, stream));
  launch_after_prior_grid(sparse_attention_combine_kernel,
                          dim3(static_cast<unsigned>(d.q_heads), static_cast<unsigned>(batch)), dim3(kCombineThreads),
                          0, stream, true, d.head_dim, d.q_heads, partial, splits, max_splits,
                          out, fused ? miss_counts : nullptr, d.group, rebuild_group_chunks(d));
}

}  // namespace shadowkv::cuda
