// Kernel 2 of the chunk selection: normalise, score, top-k and cache update for one (b, h) (see chunk_selection.cu,
// step 2). The block-wide steps live in their own headers: the softmax partials (softmax_partials.cuh), the
// one-kernel fallback (in_kernel_scoring.cuh), the radix select and compaction (radix_select.cuh) and the cache
// policy (cache_policy.cuh).
#include "selection/select_kernel.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/dispatch.cuh"
#include "common/element_access.cuh"
#include "common/float_constants.cuh"
#include "common/ordered_compaction.cuh"
#include "cuda_check.hpp"
#include "selection/cache_policy.cuh"
#include "selection/in_kernel_scoring.cuh"
#include "selection/radix_select.cuh"
#include "selection/softmax_partials.cuh"

namespace shadowkv::cuda::selection {
namespace {

constexpr int kSelectThreads = 1024;  // one CTA per (b, h): at B=1 only Hkv CTAs run, so make each wide
constexpr int kSelectWarps = kSelectThreads / 32;
static_assert(kSelectThreads == kOrderedPassThreads, "ordered_pass (ordered_compaction.cuh) needs 1024 threads");
constexpr int kScoreBatch = 8;  // chunks per thread whose logits are loaded together

/// select_kernel's static shared arrays, in the order it declares them.
constexpr std::size_t kSelectStaticShared =
    sizeof(radix_digit_scan<kSelectThreads>::TempStorage) + sizeof(unsigned) * (1U << kRadixFirstBits) +
    sizeof(float) * (2 * kSelectWarps + 2) + sizeof(unsigned) * 2 * kSelectWarps + sizeof(unsigned) * 3 + sizeof(int);
static_assert(kSelectStaticShared + 256 <= kSharedMargin,
              "kSharedMargin must cover select_kernel's static shared memory");


// kLru: a cache larger than the budget (K > k, update_lru_cache); a template parameter, so that the default cache
// (K == k) compiles to the code it had before larger caches existed.
template <typename T, bool kLru>
__global__ void __launch_bounds__(kSelectThreads, 1) select_kernel(const dims d, const layer_view* views,
                                                                   const int* batch_slots, const int layer,
                                                                   const strided_tensor queries, const int tokens,
                                                                   const step_workspace ws, const select_geometry geo) {
  __shared__ typename radix_digit_scan<kSelectThreads>::TempStorage scan_storage;
  __shared__ unsigned histogram[1 << kRadixFirstBits];
  __shared__ float scratch[2 * kSelectWarps + 2];
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
  float* logits_group = ws.logits + (static_cast<long long>(b) * d.q_heads + static_cast<long long>(h) * group) * mc;
  const std::uint8_t* outlier = view->is_outlier + static_cast<long long>(h) * mc;
  const int capacity = kLru ? d.cache_slots : k;  // K: slots per head (K == k: exactly the last selection)
  int* cache = view->cache_chunks + static_cast<long long>(h) * capacity;
  int* slot_of = view->slot_of_chunk + static_cast<long long>(h) * mc;
  int* selected = ws.selected + head_row * k;
  int* miss_slots = ws.miss_slots + head_row * k;

  float* stat_max = reinterpret_cast<float*>(select_shared);  // [G]
  float* stat_sum = stat_max + group;                           // [G]
  float* q_shared = stat_sum + group;                           // [q_floats]
  unsigned* radix_keys = geo.radix_keys_in_shared ? reinterpret_cast<unsigned*>(select_shared + geo.radix_keys_offset)
                                                  : reinterpret_cast<unsigned*>(logits_group);

  // --- A. per-query-head normalisers, or (several tokens) the summed probabilities in the logits rows -------------
  // probabilities: the rows hold p_j(c) already (-1 for non-candidates); from_scores: one row, max taken already.
  const bool probabilities = geo.mode != select_mode::from_logits;
  const int rows = geo.mode == select_mode::from_scores ? 1 : group;
  if (geo.mode == select_mode::in_kernel) {
    const T* landmarks = static_cast<const T*>(view->landmarks) + static_cast<long long>(h) * mc * d.head_dim;
    accumulate_probabilities_in_kernel<T, kSelectThreads>(d, landmarks, outlier, b, h, n, queries, tokens, logits_group,
                                                          scores_row, q_shared, scratch);
  } else if (geo.mode == select_mode::from_logits) {
    for (int g = 0; g < group; ++g) {
      float m;
      float s;
      block_softmax_partial<kSelectThreads>(logits_group + static_cast<long long>(g) * mc, n, scratch, m, s);
      if (tid == 0) {
        stat_max[g] = m;
        stat_sum[g] = s;
      }
    }
  }
  if (tid == 0) candidate_count = 0;
  __syncthreads();
  // As in the score merge (kernel 1b): p_j(c) = exp2(x * log2(e) - offset_j), offset_j = M_j * log2(e) + log2(Z_j).
  float* offset = stat_max;
  if (!probabilities) {
    for (int g = tid; g < group; g += kSelectThreads) offset[g] = stat_max[g] * kLog2e + log2f(stat_sum[g]);
  }
  __syncthreads();

  // --- B. score(c) = max_j p_j(c); radix key = float bits + 1 for candidates (scores are >= 0), 0 for the others -
  // Non-candidates are known from row 0 (logit -inf, or probability -1), so every load is unconditional and
  // kScoreBatch chunks x G rows of loads are in flight together (radix_keys may alias logits row 0: stores come last).
  // The radix select's first histogram (top 12 bits of every radix key) is counted here, saving a pass over them.
  for (int i = tid; i < (1 << kRadixFirstBits); i += kSelectThreads) histogram[i] = 0;
  __syncthreads();
  int my_candidates = 0;
  for (int base = 0; base < n; base += kSelectThreads * kScoreBatch) {
    // max_j of the exp2 argument or of the probability; with group_mean (and more than one row) the probabilities'
    // sum. A single row (from_scores) is score(c) already.
    const bool sum_rows = d.group_mean != 0 && rows > 1;
    float best[kScoreBatch];
    bool candidate[kScoreBatch];
#pragma unroll
    for (int i = 0; i < kScoreBatch; ++i) {
      candidate[i] = false;
      best[i] = probabilities || sum_rows ? 0.0F : kNegativeInfinity;
    }
#pragma unroll 4
    for (int g = 0; g < rows; ++g) {
      const float* row = logits_group + static_cast<long long>(g) * mc;
      const float shift = probabilities ? 0.0F : offset[g];
#pragma unroll
      for (int i = 0; i < kScoreBatch; ++i) {
        const int c = base + i * kSelectThreads + tid;
        const float x = c < n ? row[c] : kNegativeInfinity;
        if (g == 0) candidate[i] = probabilities ? x >= 0.0F : x != kNegativeInfinity;
        if (sum_rows) {
          best[i] += probabilities ? x : exp2f(fmaf(x, kLog2e, -shift));
        } else {
          best[i] = fmaxf(best[i], probabilities ? x : fmaf(x, kLog2e, -shift));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kScoreBatch; ++i) {
      const int c = base + i * kSelectThreads + tid;
      if (c < n) {
        const float combined = sum_rows ? best[i] / static_cast<float>(rows)
                                        : (probabilities ? best[i] : exp2f(best[i]));
        const float score = candidate[i] ? combined : 0.0F;
        my_candidates += candidate[i] ? 1 : 0;
        scores_row[c] = score;
        const unsigned radix_key = candidate[i] ? __float_as_uint(score) + 1U : 0U;
        radix_keys[c] = radix_key;
        atomicAdd(&histogram[radix_key >> (32 - kRadixFirstBits)], 1U);
      }
    }
  }
  // Not cub::BlockReduce: its sum lands in thread 0 and needs a second barrier to reach the block; an atomic a warp
  // needs the one barrier below.
  my_candidates = __reduce_add_sync(0xffffffffU, my_candidates);
  if (lane == 0 && my_candidates > 0) atomicAdd(&candidate_count, my_candidates);
  __syncthreads();
  const int candidates = candidate_count;
  const int take = min(k, candidates);

  // --- C. the take-th largest radix key: MSB-first radix select (radix_select.cuh) ------------------------------
  const radix_threshold rule =
      find_radix_threshold<kSelectThreads>(radix_keys, n, candidates, k, histogram, scan_storage, radix_found);

  // --- D. ascending compaction of the selection; radix_keys[c] becomes the "selected" flag ----------------------
  compact_top_k(radix_keys, n, take, k, rule, pass_scratch, selected);

  // --- E. temporal cache (cache_policy.cuh) ----------------------------------------------------------------------
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

void launch_select_kernel(const dims& d, int kv_type, const layer_view* views, const int* batch_slots, int layer,
                          int batch, const strided_tensor& queries, int tokens, const step_workspace& ws,
                          const select_geometry& geo, long long shared_bytes, cudaStream_t stream) {
  shadowkv_dispatch_element(kv_type, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto kernel = d.cache_slots > d.budget ? select_kernel<T, true> : select_kernel<T, false>;
    allow_shared(kernel, shared_bytes);
    const dim3 grid(static_cast<unsigned>(d.kv_heads), static_cast<unsigned>(batch));
    kernel<<<grid, kSelectThreads, static_cast<size_t>(shared_bytes), stream>>>(d, views, batch_slots, layer, queries,
                                                                               tokens, ws, geo);
    SHADOWKV_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace shadowkv::cuda::selection
