// Kernel 2 of the chunk selection: the group's scores, their radix keys, top-k and cache update for one (b, h) (see
// chunk_selection.cu, step 2). The block-wide steps live in their own headers: the score rule (group_scores.cuh), the
// radix select and compaction (radix_select.cuh) and the cache policy (cache_policy.cuh).
#include "selection/select_kernel.cuh"

#include <cstddef>
#include <cstdint>

#include "common/element_access.cuh"
#include "common/ordered_compaction.cuh"
#include "cuda_check.hpp"
#include "shadowkv/errors.hpp"
#include "selection/cache_policy.cuh"
#include "selection/group_scores.cuh"
#include "selection/radix_select.cuh"

namespace shadowkv::cuda::selection {
namespace {

constexpr int kSelectThreads = 1024;  // one CTA per (b, h): at B=1 only Hkv CTAs run, so make each wide
constexpr int kSelectWarps = kSelectThreads / 32;
static_assert(kSelectThreads == kOrderedPassThreads, "ordered_pass (ordered_compaction.cuh) needs 1024 threads");
constexpr int kScoreBatch = 4;  // chunks per thread whose logits are loaded together, two query heads at a time

/// select_kernel's static shared arrays, in the order it declares them.
constexpr std::size_t kSelectStaticShared = sizeof(radix_digit_scan<kSelectThreads>::TempStorage) +
                                            sizeof(unsigned) * (1U << kRadixFirstBits) +
                                            sizeof(unsigned) * 2 * kSelectWarps + sizeof(unsigned) * 3 + sizeof(int);
static_assert(kSelectStaticShared + 256 <= kSharedMargin,
              "kSharedMargin must cover select_kernel's static shared memory");


// kLru: a cache larger than the budget (K > k, update_lru_cache); a template parameter, so that the default cache
// (K == k) compiles to the code it had before larger caches existed.
template <bool kLru>
__global__ void __launch_bounds__(kSelectThreads, 1) select_kernel(const dims d, const layer_view* views,
                                                                   const int* batch_slots, const int layer,
                                                                   const step_workspace ws, const select_geometry geo,
                                                                   const score_input input, const int tile_rows,
                                                                   const int tiles) {
  __shared__ typename radix_digit_scan<kSelectThreads>::TempStorage scan_storage;
  __shared__ unsigned histogram[1 << kRadixFirstBits];
  __shared__ unsigned pass_scratch[2 * kSelectWarps];
  __shared__ unsigned radix_found[3];  // digit, items before its bin, items in its bin
  __shared__ int candidate_count;
  extern __shared__ __align__(16) unsigned char select_shared[];

  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int group = d.group;
  const int mc = d.max_chunks;
  const int k = d.budget;
  const layer_view* view = views + static_cast<long long>(batch_slots[b]) * d.num_layers + layer;
  const int n = context_chunks_of(view, d);
  const long long head_row = static_cast<long long>(b) * d.kv_heads + h;

  // Plain (not restrict) pointers: several of these rows are written and re-read within the kernel.
  float* scores_row = ws.scores + head_row * mc;
  // The group's G logits rows (or summed probabilities), scored here (group_scores.cuh).
  const float* logits_group = ws.logits + (static_cast<long long>(b) * d.q_heads + static_cast<long long>(h) * group) * mc;
  const int capacity = kLru ? d.cache_slots : k;  // K: slots per head (K == k: exactly the last selection)
  int* cache = view->cache_chunks + static_cast<long long>(h) * capacity;
  int* slot_of = view->slot_of_chunk + static_cast<long long>(h) * mc;
  int* selected = ws.selected + head_row * k;
  int* miss_slots = ws.miss_slots + head_row * k;
  float* offsets = reinterpret_cast<float*>(select_shared);  // [G] at byte 0 (plan_select)
  unsigned* radix_keys = geo.radix_keys_in_shared
                             ? reinterpret_cast<unsigned*>(select_shared + geo.radix_keys_offset)
                             : ws.radix_keys + head_row * mc;
  const group_score_rule scoring{input == score_input::summed_probabilities, d.group_mean != 0, group, offsets};

  // --- A. scores; radix key = float bits + 1 for candidates (scores are >= 0), 0 for the others ------------------
  // The per-query-head normalisers first (decode); then each chunk's score from its G logits, kScoreBatch chunks a
  // thread with two heads' loads in flight (8 loads: more spills registers under the 64 that 1024 threads allow), into
  // scores_row; then a pass over the thread's own scores writes the radix keys and counts the radix select's first
  // histogram (top 12 bits of every radix key), saving a pass of its own.
  if (!scoring.probabilities) {
    group_offsets<kSelectWarps>(ws.selection_partials + head_row * 2LL * group * tiles, group, tiles,
                                (n + tile_rows - 1) / tile_rows, offsets);
  }
  for (int i = tid; i < (1 << kRadixFirstBits); i += kSelectThreads) histogram[i] = 0;
  if (tid == 0) candidate_count = 0;
  __syncthreads();
  int my_candidates = 0;
  for (int base = 0; base < n; base += kSelectThreads * kScoreBatch) {
    const int remaining = n - base - tid;  // chunk base + i * kSelectThreads + tid < n iff i * kSelectThreads < remaining
    float value[kScoreBatch];
    unsigned candidate_bits = 0;  // bit i: chunk base + i * kSelectThreads + tid is a candidate
#pragma unroll
    for (int i = 0; i < kScoreBatch; ++i) value[i] = start_value(scoring);
#pragma unroll 1
    for (int g = 0; g < group; g += 2) {
      const bool second = g + 1 < group;
      const float* row = logits_group + static_cast<long long>(g) * mc + base + tid;
      const float* next_row = row + (second ? mc : 0);
      float x[kScoreBatch];
      float y[kScoreBatch];
#pragma unroll
      for (int i = 0; i < kScoreBatch; ++i) {
        x[i] = i * kSelectThreads < remaining ? row[i * kSelectThreads] : 0.0F;
        y[i] = i * kSelectThreads < remaining ? next_row[i * kSelectThreads] : 0.0F;
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
      // The merged score (>= 0, or -1 for a non-candidate) until the pass below makes it the row's score.
      if (i * kSelectThreads < remaining) {
        scores_row[base + i * kSelectThreads + tid] = finish(scoring, value[i], ((candidate_bits >> i) & 1U) != 0U);
      }
    }
  }
  // Each thread rereads only what it wrote above (same chunks, same thread: no barrier).
  for (int c = tid; c < n; c += kSelectThreads) {
    const float merged = scores_row[c];
    const bool candidate = merged >= 0.0F;
    const float score = candidate ? fmaxf(0.0F, merged) : 0.0F;
    my_candidates += candidate ? 1 : 0;
    scores_row[c] = score;
    const unsigned radix_key = candidate ? __float_as_uint(score) + 1U : 0U;
    radix_keys[c] = radix_key;
    atomicAdd(&histogram[radix_key >> (32 - kRadixFirstBits)], 1U);
  }
  // Not cub::BlockReduce: its sum lands in thread 0 and needs a second barrier to reach the block; an atomic a warp
  // needs the one barrier below.
  my_candidates = __reduce_add_sync(0xffffffffU, my_candidates);
  if (lane == 0 && my_candidates > 0) atomicAdd(&candidate_count, my_candidates);
  __syncthreads();
  const int candidates = candidate_count;
  const int take = min(k, candidates);

  // --- B. the take-th largest radix key: MSB-first radix select (radix_select.cuh) ------------------------------
  const radix_threshold rule =
      find_radix_threshold<kSelectThreads>(radix_keys, n, candidates, k, histogram, scan_storage, radix_found);

  // --- C. ascending compaction of the selection; radix_keys[c] becomes the "selected" flag ----------------------
  compact_top_k(radix_keys, n, take, k, rule, pass_scratch, selected);

  // --- D. temporal cache (cache_policy.cuh) ----------------------------------------------------------------------
  int filled;
  if constexpr (kLru) {
    // This selection's number: one more than the head's count. Every thread reads it here; thread 0 writes it back
    // below, after update_lru_cache's barriers.
    long long* clock = view->selection_clock + h;
    const long long now = *clock + 1;
    filled = update_lru_cache<kSelectThreads>(
        n, mc, k, capacity, take, now, radix_keys, selected, cache, slot_of,
        view->cache_last_used + static_cast<long long>(h) * capacity, miss_slots,
        view->selected_slots + static_cast<long long>(h) * k, histogram, scan_storage, radix_found, pass_scratch);
    if (tid == 0) *clock = now;
  } else {
    filled = update_temporal_cache(n, mc, k, take, radix_keys, selected, cache, slot_of, miss_slots, pass_scratch);
  }
  if (tid == 0) {
    ws.miss_counts[head_row] = filled;
    atomicAdd(ws.counters + 0, static_cast<unsigned long long>(take - filled));
    atomicAdd(ws.counters + 1, static_cast<unsigned long long>(filled));
    if (h == 0) atomicAdd(ws.counters + 2, 1ULL);
  }
}
}  // namespace

void launch_select_kernel(const dims& d, const layer_view* views, const int* batch_slots, int layer, int batch,
                          const step_workspace& ws, const select_geometry& geo, score_input input,
                          const logit_geometry& logit_geo, cudaStream_t stream) {
  SHADOWKV_EXPECTS(input == score_input::summed_probabilities || d.max_chunks == 0 ||
                       ws.selection_partials != nullptr,
                   "chunk selection: step_workspace::selection_partials is null (size it with "
                   "chunk_selection_workspace)");
  SHADOWKV_EXPECTS(geo.radix_keys_in_shared != 0 || ws.radix_keys != nullptr,
                   "chunk selection: max_chunks ", d.max_chunks, " needs the radix-key workspace "
                   "(step_workspace::radix_keys; size it with chunk_selection_workspace)");
  auto kernel = d.cache_slots > d.budget ? select_kernel<true> : select_kernel<false>;
  allow_shared(kernel, geo.shared_bytes);
  const dim3 grid(static_cast<unsigned>(d.kv_heads), static_cast<unsigned>(batch));
  kernel<<<grid, kSelectThreads, static_cast<size_t>(geo.shared_bytes), stream>>>(
      d, views, batch_slots, layer, ws, geo, input, logit_geo.tile_rows, logit_geo.tiles);
  SHADOWKV_CUDA_CHECK_LAUNCH();
}

}  // namespace shadowkv::cuda::selection
