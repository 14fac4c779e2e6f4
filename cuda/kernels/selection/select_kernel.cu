// Kernel 2 of the chunk selection: the group's scores, their radix keys, top-k and cache update for one (b, h) (see
// chunk_selection.cu, step 2), by one CTA (select_kernel) or by a cluster of CTAs that each rank a slice of the chunks
// (select_cluster_kernel, for small batches). The block-wide steps live in their own headers: the score rule
// (group_scores.cuh), the radix select and compaction (radix_select.cuh) and the cache policy (cache_policy.cuh).
#include "selection/select_kernel.cuh"

#include <cooperative_groups.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/dependent_launch.cuh"
#include "common/element_access.cuh"
#include "common/ordered_compaction.cuh"
#include "common/per_device_cache.hpp"
#include "common/phase_stamps.cuh"
#include "cuda_check.hpp"
#include "shadowkv/errors.hpp"
#include "selection/cache_policy.cuh"
#include "selection/group_scores.cuh"
#include "selection/radix_select.cuh"

namespace shadowkv::cuda::selection {
namespace {

namespace cg = cooperative_groups;

constexpr int kSelectThreads = 1024;  // one CTA per (b, h): at B=1 only Hkv CTAs run, so make each wide
constexpr int kSelectWarps = kSelectThreads / 32;
static_assert(kSelectThreads == kOrderedPassThreads, "ordered_pass (ordered_compaction.cuh) needs 1024 threads");
constexpr int kScoreBatch = 4;  // chunks per thread whose logits are loaded together, two query heads at a time
/// select_cluster_kernel's hint path: at most this many keys at or above the hint (own_second's entries; two a thread
/// when every CTA gathers them).
constexpr int kHintKeys = 1 << 11;
static_assert(kHintKeys <= 2 * kSelectThreads, "the hint path holds two keys a thread");
/// The next hint sits where the count from the top reaches this many times k (kHintKeys / 4 at k = 256).
constexpr int kHintTargetFactor = 2;

/// select_kernel's static shared arrays, in the order it declares them.
constexpr std::size_t kSelectStaticShared = sizeof(radix_digit_scan<kSelectThreads>::TempStorage) +
                                            sizeof(unsigned) * (1U << kRadixFirstBits) +
                                            sizeof(unsigned) * 2 * kSelectWarps + sizeof(unsigned) * 3 + sizeof(int);
static_assert(kSelectStaticShared + 256 <= kSharedMargin,
              "kSharedMargin must cover select_kernel's static shared memory");
/// select_cluster_kernel's static shared arrays, in the order it declares them.
constexpr std::size_t kClusterStaticBytes =
    sizeof(radix_digit_scan<kSelectThreads>::TempStorage) + sizeof(unsigned) * (1U << kRadixFirstBits) +
    sizeof(unsigned) * (1U << 11) + sizeof(unsigned) * (1U << kRadixFirstBits) + sizeof(unsigned) * 2 * kSelectWarps +
    sizeof(unsigned) * 4 + sizeof(int) * 2 + sizeof(int) * kMaxSelectCluster + sizeof(uint2) + sizeof(unsigned) * 5 +
    sizeof(int*) * 2 + sizeof(unsigned*);
static_assert(kClusterStaticBytes + 256 <= kClusterStaticShared,
              "kClusterStaticShared must cover select_cluster_kernel's static shared memory");

/// What both select kernels know of their (b, h) row; the row's workspace pointers are computed where they are used
/// (held across the kernel, they cost registers under the 64 that 1024 threads allow).
struct select_row {
  const layer_view* view;
  int n;               ///< context chunks
  long long head_row;  ///< b * Hkv + h
  [[nodiscard]] __device__ float* scores(const dims& d, const step_workspace& ws) const {
    return ws.scores + head_row * d.max_chunks;  // plain, not restrict: written and re-read within the kernel
  }
  /// The group's G logits rows (or summed probabilities): rows h * G .. h * G + G - 1 of sequence b.
  [[nodiscard]] __device__ const float* logits_group(const dims& d, const step_workspace& ws) const {
    return ws.logits + head_row * d.group * d.max_chunks;
  }
  [[nodiscard]] __device__ int* selected(const dims& d, const step_workspace& ws) const {
    return ws.selected + head_row * d.budget;
  }
  [[nodiscard]] __device__ int* miss_slots(const dims& d, const step_workspace& ws) const {
    return ws.miss_slots + head_row * d.budget;
  }
};

__device__ __forceinline__ select_row row_of(const dims& d, const layer_view* views, const int* batch_slots, int layer,
                                             int b, int h) {
  select_row row{};
  row.view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  row.n = context_chunks_of(row.view, d);
  row.head_row = static_cast<long long>(b) * d.kv_heads + h;
  return row;
}

/// Step A of both kernels for chunks [first, end): each chunk's score from its G logits, kScoreBatch chunks a thread
/// with two heads' loads in flight (8 loads: more spills registers under the 64 that 1024 threads allow), into
/// row.scores, with its radix key (float bits + 1 for candidates, whose scores are >= 0; 0 for the others) and its
/// count in the radix select's first histogram (top 12 bits of every radix key) from the same registers, saving a
/// pass of its own. (Until session 16 the keys came from a second pass that reread each score from global memory:
/// one load after a store to the same array, which the compiler keeps in order, so ~15 L2 round trips a thread at
/// S = 122880, one after another.) radix_keys[c - key_base] is chunk c's key. Returns the thread's candidates. The
/// caller has written `scoring`'s offsets and zeroed `histogram`, and synchronised.
///
/// `hint` > 0 (select_cluster_kernel's hint path): the radix keys >= hint are also appended to hint_keys (at most
/// hint_capacity of them; *hint_count counts them all, beyond the capacity too).
__device__ __forceinline__ int score_chunks(const group_score_rule& scoring, const dims& d, const step_workspace& ws,
                                            const select_row& row, int first, int end, unsigned* radix_keys,
                                            int key_base, unsigned* histogram, unsigned hint = 0, unsigned* hint_keys = nullptr,
                                            int hint_capacity = 0, int* hint_count = nullptr) {
  const int tid = threadIdx.x;
  const int mc = d.max_chunks;
  float* scores = row.scores(d, ws);
  const float* logits_group = row.logits_group(d, ws);
  int candidates = 0;
  for (int base = first; base < end; base += kSelectThreads * kScoreBatch) {
    const int remaining = end - base - tid;  // chunk base + i * kSelectThreads + tid < end iff i * kSelectThreads < remaining
    float value[kScoreBatch];
    unsigned candidate_bits = 0;  // bit i: chunk base + i * kSelectThreads + tid is a candidate
#pragma unroll
    for (int i = 0; i < kScoreBatch; ++i) value[i] = start_value(scoring);
#pragma unroll 1
    for (int g = 0; g < scoring.group; g += 2) {
      const bool second = g + 1 < scoring.group;
      const float* logits = logits_group + static_cast<long long>(g) * mc + base + tid;
      const float* next_logits = logits + (second ? mc : 0);
      float x[kScoreBatch];
      float y[kScoreBatch];
#pragma unroll
      for (int i = 0; i < kScoreBatch; ++i) {
        x[i] = i * kSelectThreads < remaining ? logits[i * kSelectThreads] : 0.0F;
        y[i] = i * kSelectThreads < remaining ? next_logits[i * kSelectThreads] : 0.0F;
      }
#pragma unroll
      for (int i = 0; i < kScoreBatch; ++i) {
        if (g == 0 && is_candidate(scoring, x[i])) candidate_bits |= 1U << i;
        value[i] = add_head(scoring, value[i], g, x[i]);
        if (second) value[i] = add_head(scoring, value[i], g + 1, y[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kScoreBatch; ++i) {
      if (i * kSelectThreads < remaining) {
        // The merged score is >= 0, or -1 for a non-candidate.
        const float merged = finish(scoring, value[i], ((candidate_bits >> i) & 1U) != 0U);
        const bool candidate = merged >= 0.0F;
        const float score = candidate ? fmaxf(0.0F, merged) : 0.0F;
        const int c = base + i * kSelectThreads + tid;
        candidates += candidate ? 1 : 0;
        scores[c] = score;
        const unsigned radix_key = candidate ? __float_as_uint(score) + 1U : 0U;
        radix_keys[c - key_base] = radix_key;
        atomicAdd(&histogram[radix_key >> (32 - kRadixFirstBits)], 1U);
        if (hint != 0U && radix_key >= hint) {
          const int at = atomicAdd(hint_count, 1);
          if (at < hint_capacity) hint_keys[at] = radix_key;
        }
      }
    }
  }
  return candidates;
}

/// Step A's preamble in both kernels: the per-query-head normalisers (decode) into `offsets`, and the first histogram
/// and the candidate count zeroed. Ends with a barrier.
__device__ __forceinline__ void start_scoring(const group_score_rule& scoring, const step_workspace& ws,
                                              const select_row& row, int tile_rows, int tiles, unsigned* histogram,
                                              int* candidate_count) {
  if (!scoring.probabilities) {
    group_offsets<kSelectWarps>(ws.selection_partials + row.head_row * 2LL * scoring.group * tiles, scoring.group, tiles,
                                (row.n + tile_rows - 1) / tile_rows, const_cast<float*>(scoring.offsets));
  }
  for (int i = threadIdx.x; i < (1 << kRadixFirstBits); i += kSelectThreads) histogram[i] = 0;
  if (threadIdx.x == 0) *candidate_count = 0;
  __syncthreads();
}

/// Adds the block's candidates to *candidate_count. Not cub::BlockReduce: its sum lands in thread 0 and needs a second
/// barrier to reach the block; an atomic a warp needs the one barrier the caller has next.
__device__ __forceinline__ void count_candidates(int mine, int* candidate_count) {
  mine = __reduce_add_sync(0xffffffffU, mine);
  if ((threadIdx.x & 31) == 0 && mine > 0) atomicAdd(candidate_count, mine);
}

/// The row's misses (those that got a slot) and the step's counters: hits, misses, selections.
__device__ __forceinline__ void record_misses(const step_workspace& ws, const select_row& row, int h, int take,
                                              int filled) {
  if (threadIdx.x == 0) {
    ws.miss_counts[row.head_row] = filled;
    atomicAdd(ws.counters + 0, static_cast<unsigned long long>(take - filled));
    atomicAdd(ws.counters + 1, static_cast<unsigned long long>(filled));
    if (h == 0) atomicAdd(ws.counters + 2, 1ULL);
  }
}

/// Step D of both kernels (by one CTA): the temporal cache (cache_policy.cuh) and the step's counters.
template <bool kLru>
__device__ __forceinline__ void update_cache(const dims& d, const step_workspace& ws, const select_row& row, int h,
                                             int take, unsigned* radix_keys, unsigned* histogram,
                                             typename radix_digit_scan<kSelectThreads>::TempStorage& scan_storage,
                                             unsigned* radix_found, unsigned* pass_scratch) {
  const int k = d.budget;
  const int capacity = kLru ? d.cache_slots : k;  // K: slots per head (K == k: exactly the last selection)
  const layer_view* view = row.view;
  int* cache = view->cache_chunks + static_cast<long long>(h) * capacity;
  int* slot_of = view->slot_of_chunk + static_cast<long long>(h) * d.max_chunks;
  int filled;
  if constexpr (kLru) {
    // This selection's number: one more than the head's count. Every thread reads it here; thread 0 writes it back
    // below, after update_lru_cache's barriers.
    long long* clock = view->selection_clock + h;
    const long long now = *clock + 1;
    filled = update_lru_cache<kSelectThreads>(
        row.n, d.max_chunks, k, capacity, take, now, radix_keys, row.selected(d, ws), cache, slot_of,
        view->cache_last_used + static_cast<long long>(h) * capacity, row.miss_slots(d, ws),
        view->selected_slots + static_cast<long long>(h) * k, histogram, scan_storage, radix_found, pass_scratch);
    if (threadIdx.x == 0) *clock = now;
  } else {
    filled = update_temporal_cache(row.n, d.max_chunks, k, take, radix_keys, row.selected(d, ws), cache, slot_of,
                                   row.miss_slots(d, ws), pass_scratch);
  }
  record_misses(ws, row, h, take, filled);
}

// kLru: a cache larger than the budget (K > k, update_lru_cache); a template parameter, so that the default cache
// (K == k) compiles to the code it had before larger caches existed.
template <bool kLru>
__global__ void __launch_bounds__(kSelectThreads, 1) select_kernel(const dims d, const layer_view* views,
                                                                   const int* batch_slots, const int layer,
                                                                   const step_workspace ws, const select_geometry geo,
                                                                   const score_input input, const int tile_rows,
                                                                   const int tiles) {
  start_phase_stamps(stamped_kernel::select);
  wait_for_prior_grids();  // common/dependent_launch.cuh: nothing before the previous kernel is done
  phase_stamp(stamped_kernel::select, 1);
  __shared__ typename radix_digit_scan<kSelectThreads>::TempStorage scan_storage;
  __shared__ unsigned histogram[1 << kRadixFirstBits];
  __shared__ unsigned pass_scratch[2 * kSelectWarps];
  __shared__ unsigned radix_found[3];  // digit, items before its bin, items in its bin
  __shared__ int candidate_count;
  extern __shared__ __align__(16) unsigned char select_shared[];

  const int h = blockIdx.x;
  const select_row row = row_of(d, views, batch_slots, layer, blockIdx.y, h);
  float* offsets = reinterpret_cast<float*>(select_shared);  // [G] at byte 0 (plan_select)
  unsigned* radix_keys = geo.radix_keys_in_shared
                             ? reinterpret_cast<unsigned*>(select_shared + geo.radix_keys_offset)
                             : ws.radix_keys + row.head_row * d.max_chunks;
  const group_score_rule scoring{input == score_input::summed_probabilities, d.group_mean != 0, d.group, offsets};

  // --- A. scores, radix keys and the first histogram (score_chunks) --------------------------------------------
  start_scoring(scoring, ws, row, tile_rows, tiles, histogram, &candidate_count);
  phase_stamp(stamped_kernel::select, 2);
  count_candidates(score_chunks(scoring, d, ws, row, 0, row.n, radix_keys, 0, histogram), &candidate_count);
  __syncthreads();
  phase_stamp(stamped_kernel::select, 4);
  const int candidates = candidate_count;
  const int take = min(d.budget, candidates);

  // --- B. the take-th largest radix key: MSB-first radix select (radix_select.cuh) ------------------------------
  const radix_threshold rule = find_radix_threshold<kSelectThreads>(radix_keys, row.n, candidates, d.budget, histogram,
                                                                    scan_storage, radix_found);
  phase_stamp(stamped_kernel::select, 8);

  // --- C. ascending compaction of the selection; radix_keys[c] becomes the "selected" flag ----------------------
  compact_top_k(radix_keys, row.n, take, d.budget, rule, pass_scratch, row.selected(d, ws));
  phase_stamp(stamped_kernel::select, 9);

  // --- D. temporal cache (cache_policy.cuh) ----------------------------------------------------------------------
  update_cache<kLru>(d, ws, row, h, take, radix_keys, histogram, scan_storage, radix_found, pass_scratch);
  finish_phase_stamps(stamped_kernel::select, 18);
}

// The same four steps by a cluster of CTAs per (b, h) (grid (Hkv * cluster, B)): CTA r of the cluster scores and
// ranks the r-th slice of the chunks (its radix keys in its shared memory: cluster_shared_layout); the radix select's
// histograms are the sums of the CTAs' own, read from each other's shared memory, so that every CTA finds the same
// threshold; the compaction starts each CTA's ids after the counts of the CTAs before it; and the first CTA updates
// the cache alone: K == k from the head's cache, which it reads into its shared memory while the cluster scores, and
// the selected ids, which every CTA's compaction stores there too (update_temporal_cache_shared); K > k from the
// selected flags the compaction leaves in ws.radix_keys (update_lru_cache). Between the steps, cluster barriers
// (release/acquire at cluster scope: they order the global and distributed shared writes of the ids and flags too).
template <bool kLru>
__global__ void __launch_bounds__(kSelectThreads, 1) select_cluster_kernel(const dims d, const layer_view* views,
                                                                           const int* batch_slots, const int layer,
                                                                           const step_workspace ws,
                                                                           const score_input input,
                                                                           const int tile_rows, const int tiles) {
  start_phase_stamps(stamped_kernel::select);
  wait_for_prior_grids();  // common/dependent_launch.cuh: nothing before the previous kernel is done
  phase_stamp(stamped_kernel::select, 1);
  __shared__ typename radix_digit_scan<kSelectThreads>::TempStorage scan_storage;
  __shared__ unsigned own_histogram[1 << kRadixFirstBits];  // this CTA's counts of digits 0 and 2 (read by the cluster)
  __shared__ unsigned own_second[1 << 11];                  // of digit 1: a second array, see below
  __shared__ unsigned merged[1 << kRadixFirstBits];         // the cluster's counts of the digit
  __shared__ unsigned pass_scratch[2 * kSelectWarps];
  __shared__ unsigned radix_found[4];
  __shared__ int candidate_count;  // this CTA's (read by the cluster)
  __shared__ int hint_count;       // this CTA's radix keys >= the hint (read by the cluster)
  __shared__ int hint_counts[kMaxSelectCluster];  // every rank's, copied here for the gather of the hint path
  __shared__ uint2 block_totals;   // this CTA's compaction counts (read by the CTAs after it)
  __shared__ unsigned hint_rule[3];  // the hint path's rule (prefix, ties, next hint's bin), stored by the CTA finding it
  __shared__ unsigned hint_before[2];  // the hint path: keys above and equal to the k-th in the ranks before this one
  __shared__ int* head_rows[2];        // K == k, the first CTA: the head's cache and slot_of rows
  __shared__ unsigned* hint_at_end[1];  // the first CTA: the hint row, for its last store
  extern __shared__ __align__(16) unsigned char select_shared[];

  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int ctas = static_cast<int>(cluster.num_blocks());
  const int tid = threadIdx.x;
  const int h = blockIdx.x / ctas;
  const select_row row = row_of(d, views, batch_slots, layer, blockIdx.y, h);
  const int slice = ((row.n + ctas - 1) / ctas + 31) / 32 * 32;  // whole warps' worth a CTA (<= slice_capacity)
  const int first = min(row.n, rank * slice);
  const int end = min(row.n, first + slice);
  const cluster_shared_layout layout = cluster_shared_layout_for(d, ctas);
  unsigned* slice_keys = reinterpret_cast<unsigned*>(select_shared + layout.slice_keys);  // chunk c at c - first
  float* offsets = reinterpret_cast<float*>(select_shared);  // [G]
  const group_score_rule scoring{input == score_input::summed_probabilities, d.group_mean != 0, d.group, offsets};

  // The hint: where the previous selection of this (sequence, layer, head) says the take-th largest key may lie
  // (0: none). Read by every CTA before the first cluster barrier; the first CTA writes the next one after the last.
  unsigned* const hint_row = row.view->selection_hint;
  const bool hints = hint_row != nullptr;
  const unsigned hint = hints ? hint_row[h] : 0U;

  // K == k: the first CTA keeps the head's cache in its shared memory for step D (cluster_shared_layout): the slots'
  // chunks are read here and stored, with their bits, while the cluster scores (the barriers before step D order
  // them); the bitmaps are cleared before start_scoring's barrier.
  int* cache_chunks = reinterpret_cast<int*>(select_shared + layout.cache_chunks);
  int* selected_ids = reinterpret_cast<int*>(select_shared + layout.selected_ids);
  unsigned* selected_bits = reinterpret_cast<unsigned*>(select_shared + layout.selected_bits);
  unsigned* cached_bits = reinterpret_cast<unsigned*>(select_shared + layout.cached_bits);
  const bool cache_keeper = !kLru && rank == 0;
  // The head's cache and slot_of rows: their pointers are read here and parked in shared memory (held in registers
  // across the kernel they would spill; read again from the view at step D, they put a round trip before its
  // first store).
  int* head_cache = nullptr;
  int* head_slot_of = nullptr;
  int first_slot_chunk = -1;
  if (cache_keeper) {
    for (int i = tid; i < layout.bitmap_words; i += kSelectThreads) {
      selected_bits[i] = 0U;
      cached_bits[i] = 0U;
    }
    head_cache = row.view->cache_chunks + static_cast<long long>(h) * d.budget;
    if (tid < d.budget) first_slot_chunk = head_cache[tid];
    if (tid == 0) head_slot_of = row.view->slot_of_chunk + static_cast<long long>(h) * d.max_chunks;
  }

  // --- A. this CTA's slice --------------------------------------------------------------------------------------
  // own_second (digit 1's counts on the full path) holds the slice's keys >= hint meanwhile.
  if (tid == 0) {
    hint_count = 0;
    hint_rule[2] = kNoHintBin;  // before the first cluster barrier: the stores of the hint path come after it
    hint_before[0] = 0U;
    hint_before[1] = 0U;
  }
  start_scoring(scoring, ws, row, tile_rows, tiles, own_histogram, &candidate_count);
  phase_stamp(stamped_kernel::select, 2);
  if (tid == 0) hint_at_end[0] = hint_row;  // (read by this thread alone, at the end: a register held so long spills)
  if (cache_keeper) {
    if (tid == 0) {
      head_rows[0] = head_cache;
      head_rows[1] = head_slot_of;
    }
    auto keep = [&](int s, int c) {
      cache_chunks[s] = c;
      if (c >= 0 && c < d.max_chunks) atomicOr(&cached_bits[c >> 5], 1U << (c & 31));
    };
    if (tid < d.budget) keep(tid, first_slot_chunk);
    for (int s = tid + kSelectThreads; s < d.budget; s += kSelectThreads) keep(s, head_cache[s]);
  }
  count_candidates(score_chunks(scoring, d, ws, row, first, end, slice_keys, first, own_histogram, hint, own_second,
                                kHintKeys, &hint_count),
                   &candidate_count);
  phase_stamp(stamped_kernel::select, 3);
  cluster.sync();
  phase_stamp(stamped_kernel::select, 4);
  int candidates = 0;
  for (int r = 0; r < ctas; ++r) candidates += *cluster.map_shared_rank(&candidate_count, r);
  const int take = min(d.budget, candidates);
  int hinted = 0;  // the cluster's keys >= hint
  if (hint != 0U) {
    if (tid < ctas) hint_counts[tid] = *cluster.map_shared_rank(&hint_count, tid);
    __syncthreads();
    for (int r = 0; r < ctas; ++r) hinted += hint_counts[r];
  }
  // The hint path, when more than k keys and at most kHintKeys lie at or above the hint: the take-th largest key is
  // then among them, and so is every key the selection could take, so the rule found from them alone (to the last
  // bit) takes what the full radix select takes. Every CTA decides alike from the cluster's counts.
  const bool hint_path = hint != 0U && candidates > d.budget && hinted > d.budget && hinted <= kHintKeys;
  // The next hint: the smallest key of the first digit's bin where the count from the top reaches kHintTargetFactor
  // x k (radix_threshold::hint_bin), so that next step's count above it lands between k and kHintKeys while the
  // scores move by less than a bin or two.
  const unsigned hint_target = hints ? static_cast<unsigned>(kHintTargetFactor * d.budget) : 0U;

  // --- B. the threshold: from the keys at or above the hint, or from the cluster's histograms --------------------
  radix_threshold rule{};
  if (hint_path) {
    // Every CTA gathers the cluster's keys >= hint into its `merged` (a remote load a thread, two at most; the ranks'
    // own_second are read until the cluster barrier below, and nothing writes them on this path), then counts, for
    // its share of them (key i for i % ctas == rank), the keys above and equal to it: 8 lanes a key, each over an
    // 8th of the keys as 16-byte vectors (128 keys a round: one round for the ~550 keys of B = 1). The key with fewer than k above it and at least k at or above it is the
    // k-th largest; its CTA stores the rule to every CTA's hint_rule (and the owner of the hint_target-th largest
    // the next hint's bin), and a cluster barrier hands them over. (Until session 19 each CTA searched the k-th key
    // bit by bit, one counting block barrier a bit: 43 of them, ~4 µs.) Keys of candidates are float bits + 1 of
    // scores >= 0, never 0: the zero padding of the last vector is below every key.
    unsigned* keys = merged;
    for (int at = tid; at < hinted; at += kSelectThreads) {
      int r = 0;
      int start = 0;
      while (start + hint_counts[r] <= at) start += hint_counts[r++];
      keys[at] = cluster.map_shared_rank(own_second, r)[at - start];
    }
    if (tid < 4) keys[hinted + tid] = 0U;
    __syncthreads();
    phase_stamp(stamped_kernel::select, 5);
    constexpr int kLanesPerKey = 8;
    constexpr int kKeysPerRound = kSelectThreads / kLanesPerKey;
    const int part = tid % kLanesPerKey;
    const int vectors = (hinted + 3) / 4;
    const int own_keys = (hinted - rank + ctas - 1) / ctas;  // i = rank + ctas * m, m < own_keys
    const unsigned k = static_cast<unsigned>(d.budget);
    for (int round = 0; round < own_keys; round += kKeysPerRound) {  // uniform: every lane shuffles
      const int m = round + tid / kLanesPerKey;
      const int i = rank + ctas * m;
      const unsigned key = m < own_keys ? keys[i] : 0U;
      unsigned above = 0U;
      unsigned equal = 0U;
      for (int v = part; v < vectors; v += kLanesPerKey) {
        const uint4 x = reinterpret_cast<const uint4*>(keys)[v];
        above += (x.x > key ? 1U : 0U) + (x.y > key ? 1U : 0U) + (x.z > key ? 1U : 0U) + (x.w > key ? 1U : 0U);
        equal += (x.x == key ? 1U : 0U) + (x.y == key ? 1U : 0U) + (x.z == key ? 1U : 0U) + (x.w == key ? 1U : 0U);
      }
#pragma unroll
      for (int offset = kLanesPerKey / 2; offset > 0; offset >>= 1) {
        above += __shfl_xor_sync(0xffffffffU, above, offset);
        equal += __shfl_xor_sync(0xffffffffU, equal, offset);
      }
      if (part == 0 && m < own_keys) {
        const bool kth = above < k && above + equal >= k;
        const bool edge = hint_target > 0U && static_cast<unsigned>(hinted) >= hint_target && above < hint_target &&
                          above + equal >= hint_target;
        for (int r = 0; r < ctas && (kth || edge); ++r) {
          unsigned* rule_of_rank = cluster.map_shared_rank(hint_rule, r);
          if (kth) {
            rule_of_rank[0] = key;
            rule_of_rank[1] = k - above;
          }
          if (edge) rule_of_rank[2] = key >> (32 - kRadixFirstBits);
        }
      }
    }
    cluster.sync();
    // The rule on the whole key: take every key above the k-th, and of those equal to it the first (k - above). The
    // next hint, as the full path finds it: the first digit's bin of the hint_target-th largest key (when at least
    // that many lie above the hint; else the hint stays).
    rule.prefix = hint_rule[0];
    rule.mask = 0xffffffffU;
    rule.need_ties = hint_rule[1];
    rule.hint_bin = hint_rule[2];
    // The compaction's counts before this CTA's slice: every key above or equal to the k-th is >= hint, so the keys
    // of the ranks before this one in `keys` (gathered in rank order) are all of them. Counted here, they save the
    // compaction its cluster barrier and the exchange of the CTAs' totals.
    int before_rank = 0;
    for (int r = 0; r < rank; ++r) before_rank += hint_counts[r];
    unsigned above_here = 0U;
    unsigned equal_here = 0U;
    for (int at = tid; at < before_rank; at += kSelectThreads) {
      above_here += keys[at] > rule.prefix ? 1U : 0U;
      equal_here += keys[at] == rule.prefix ? 1U : 0U;
    }
    above_here = __reduce_add_sync(0xffffffffU, above_here);
    equal_here = __reduce_add_sync(0xffffffffU, equal_here);
    if ((tid & 31) == 0 && (above_here | equal_here) != 0U) {
      atomicAdd(&hint_before[0], above_here);
      atomicAdd(&hint_before[1], equal_here);
    }
    __syncthreads();
  } else {
  // Digit 1 is counted into own_second, digit 2 into own_histogram again: a CTA clears own_histogram for digit 2 only
  // after the cluster barrier that follows digit 1's counting, which every CTA reaches after its merge of digit 0.
  rule = radix_threshold_from<kSelectThreads>(
      candidates, d.budget,
      [&](int pass, radix_digit digit, unsigned prefix, unsigned mask) -> const unsigned* {
        unsigned* own = pass == 1 ? own_second : own_histogram;
        if (pass > 0) {  // the first histogram was counted in step A
          for (int i = tid; i < digit.bins(); i += kSelectThreads) own[i] = 0;
          __syncthreads();
          for (int i = tid; i < end - first; i += kSelectThreads) {
            const unsigned radix_key = slice_keys[i];
            if ((radix_key & mask) == prefix) atomicAdd(&own[digit.of(radix_key)], 1U);
          }
          phase_stamp(stamped_kernel::select, 20 + pass);
          cluster.sync();
          phase_stamp(stamped_kernel::select, 25 + pass);
        }
        // Reduce-scatter, then gather: CTA r sums its own slice of the bins over the ranks into its merged (bins
        // loads a CTA), and after a cluster barrier every CTA copies the other slices from their owners' merged
        // (bins x (ctas - 1) / ctas loads). The merge is bound by the distributed shared memory's throughput, not
        // by each load's latency (docs/performance.md; session 14), so fewer loads is what shortens it. A CTA writes
        // only its own slice of its merged and reads only the others' slices of theirs; the next pass writes its
        // slice again only after the cluster barrier that follows its counting, which every CTA reaches after this
        // gather.
        const int slice_bins = (digit.bins() + ctas - 1) / ctas;
        const int own_first = rank * slice_bins;
        const int own_end = min(digit.bins(), own_first + slice_bins);
        for (int i = own_first + tid; i < own_end; i += kSelectThreads) {
          unsigned sum = 0;
          for (int r = 0; r < ctas; ++r) sum += cluster.map_shared_rank(own, r)[i];
          merged[i] = sum;
        }
        cluster.sync();
        for (int i = tid; i < digit.bins(); i += kSelectThreads) {
          const int owner = i / slice_bins;
          if (owner != rank) merged[i] = cluster.map_shared_rank(merged, owner)[i];
        }
        __syncthreads();
        phase_stamp(stamped_kernel::select, 10 + pass);
        return merged;
      },
      scan_storage, radix_found, hint_target);
  }
  phase_stamp(stamped_kernel::select, 8);

  // --- C. compaction: this CTA's ids go after those of the CTAs before it ----------------------------------------
  // K == k: each id to the first CTA's selected_ids too; K > k: every chunk's flag to ws.radix_keys.
  int* first_cta_ids = cluster.map_shared_rank(selected_ids, 0);
  unsigned* flags = ws.radix_keys + row.head_row * d.max_chunks;
  compact_by_rule(
      first, end, take, d.budget, rule, pass_scratch, row.selected(d, ws), [&](int c) { return slice_keys[c - first]; },
      [&](int c, unsigned at) {
        if constexpr (!kLru) first_cta_ids[at] = c;
      },
      [&](int c, bool taken) {
        if constexpr (kLru) flags[c] = taken ? 1U : 0U;
      },
      [&](uint2 totals) {
    if (hint_path) return make_uint2(hint_before[0], hint_before[1]);  // (cluster-uniform)
    if (tid == 0) block_totals = totals;
    cluster.sync();
    uint2 before = make_uint2(0U, 0U);
    for (int r = 0; r < rank; ++r) {
      const uint2 other = *cluster.map_shared_rank(&block_totals, r);
      before.x += other.x;
      before.y += other.y;
    }
    return before;
  });
  phase_stamp(stamped_kernel::select, 9);
  // Every CTA's ids and flags written, and no CTA reads another's shared memory after this barrier.
  cluster.sync();
  phase_stamp(stamped_kernel::select, 19);
  if (rank != 0) return;

  // --- D. temporal cache, by the cluster's first CTA --------------------------------------------------------------
  if constexpr (kLru) {
    update_cache<true>(d, ws, row, h, take, flags, own_histogram, scan_storage, radix_found, pass_scratch);
  } else {
    const int filled = update_temporal_cache_shared(
        row.n, d.max_chunks, d.budget, take, selected_ids, cache_chunks, cached_bits, selected_bits,
        reinterpret_cast<int*>(select_shared + layout.free_slots),
        reinterpret_cast<int*>(select_shared + layout.miss_chunks), head_rows[0], head_rows[1], row.miss_slots(d, ws),
        pass_scratch);
    record_misses(ws, row, h, take, filled);
  }
  if (tid == 0 && hints) {
    // Not reached on the hint path (fewer than the target at or above the hint): the hint stays, it found k.
    hint_at_end[0][h] = rule.hint_bin != kNoHintBin ? rule.hint_bin << (32 - kRadixFirstBits) : (hint_path ? hint : 0U);
    if (hint_path && ws.hinted_selections != nullptr) atomicAdd(ws.hinted_selections, 1ULL);
  }
  finish_phase_stamps(stamped_kernel::select, 18);
}

}  // namespace

namespace {

/// Lets select_cluster_kernel<lru> take every byte of dynamic shared memory the device allows beside its static
/// arrays (the planner checks a layout's fit against the same margin): one value a device and kernel, set once, so
/// that concurrent launches of other sizes never see it lowered. A host-side attribute, legal while a stream is being
/// captured. Returns those bytes.
int allow_cluster_shared(bool lru) {
  static per_device_cache<int> allowed[2];
  return allowed[lru ? 1 : 0].get(0, [&](int device, int) {
    int optin = 0;
    SHADOWKV_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    SHADOWKV_CUDA_TRY(cudaFuncSetAttribute(lru ? select_cluster_kernel<true> : select_cluster_kernel<false>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, optin - kClusterStaticShared));
    return optin - kClusterStaticShared;
  });
}

cudaLaunchAttribute cluster_attribute(int cluster) {
  cudaLaunchAttribute in_clusters{};
  in_clusters.id = cudaLaunchAttributeClusterDimension;
  in_clusters.val.clusterDim.x = static_cast<unsigned>(cluster);
  in_clusters.val.clusterDim.y = 1;
  in_clusters.val.clusterDim.z = 1;
  return in_clusters;
}

}  // namespace

int select_clusters_at_once(int cluster) {
  SHADOWKV_EXPECTS(cluster == 2 || cluster == 4 || cluster == 8,
                   "chunk selection: select clusters have 2, 4 or 8 CTAs, got ", cluster);
  static per_device_cache<int> known;
  return known.get(cluster, [](int, int size) {
    int fewest = 0;
    for (const bool lru : {false, true}) {
      cudaLaunchAttribute in_clusters = cluster_attribute(size);
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(static_cast<unsigned>(size));
      config.blockDim = dim3(kSelectThreads);
      config.dynamicSmemBytes = static_cast<std::size_t>(allow_cluster_shared(lru));
      config.attrs = &in_clusters;
      config.numAttrs = 1;
      int clusters = 0;
      SHADOWKV_CUDA_TRY(cudaOccupancyMaxActiveClusters(
          &clusters, lru ? select_cluster_kernel<true> : select_cluster_kernel<false>, &config));
      fewest = lru ? std::min(fewest, clusters) : clusters;
    }
    return fewest;
  });
}

void launch_select_kernel(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                          const step_workspace& ws, const select_geometry& geo, int cluster, score_input input,
                          const logit_geometry& logit_geo, cudaStream_t stream) {
  SHADOWKV_EXPECTS(input == score_input::summed_probabilities || d.max_chunks == 0 ||
                       ws.selection_partials != nullptr,
                   "chunk selection: step_workspace::selection_partials is null (size it with "
                   "chunk_selection_workspace)");
  SHADOWKV_EXPECTS(cluster == 1 || cluster == 2 || cluster == 4 || cluster == 8,
                   "chunk selection: the select kernel runs in clusters of 1, 2, 4 or 8 CTAs, got ", cluster);
  SHADOWKV_EXPECTS((geo.radix_keys_in_shared != 0 && cluster == 1) || ws.radix_keys != nullptr,
                   "chunk selection: max_chunks ", d.max_chunks, (cluster > 1 ? " in clusters" : ""),
                   " needs the radix-key workspace (step_workspace::radix_keys; size it with "
                   "chunk_selection_workspace)");
  const bool lru = d.cache_slots > d.budget;
  if (cluster > 1) {
    auto kernel = lru ? select_cluster_kernel<true> : select_cluster_kernel<false>;
    const long long shared_bytes = cluster_shared_layout_for(d, cluster).bytes;
    allow_cluster_shared(lru);
    cudaLaunchAttribute in_clusters = cluster_attribute(cluster);
    launch_after_prior_grid_with(&in_clusters, 1, kernel,
                                 dim3(static_cast<unsigned>(d.kv_heads * cluster), static_cast<unsigned>(batch)),
                                 dim3(kSelectThreads), shared_bytes, stream, true, d, views,
                                 batch_slots, layer, ws, input, logit_geo.tile_rows, logit_geo.tiles);
    return;
  }
  auto kernel = lru ? select_kernel<true> : select_kernel<false>;
  allow_shared(kernel, geo.shared_bytes);
  const dim3 grid(static_cast<unsigned>(d.kv_heads), static_cast<unsigned>(batch));
  launch_after_prior_grid(kernel, grid, dim3(kSelectThreads), static_cast<std::size_t>(geo.shared_bytes), stream,
                          true, d, views, batch_slots, layer, ws, geo, input,
                          logit_geo.tile_rows, logit_geo.tiles);
}

}  // namespace shadowkv::cuda::selection
