// A chunk's score from the logits of its KV head's query-head group: the per-query-head normalisers (from the
// landmark logits kernel's tile partials) and the max or mean over the group of p_j(c). The select kernel
// (select_kernel.cu) applies it to every chunk it ranks, so the scores need no kernel and no pass of their own.
#pragma once

#include <cuda_runtime.h>

#include "common/float_constants.cuh"
#include "device_layout.cuh"
#include "selection/softmax_partials.cuh"

namespace shadowkv::cuda::selection {

/// What the logits rows hold when the select kernel scores them. int-sized: it travels in a kernel argument.
enum class score_input : int {
  logits_and_partials,   ///< decode: logits rows, and the logits kernel's tile partials (step_workspace::selection_partials)
  summed_probabilities,  ///< several tokens: p_j(c) summed over the tokens (-1 for non-candidates)
};

/// offsets[j] = M_j * log2(e) + log2(Z_j) for each query head j of the group, so that p_j(c) = exp2(x_j(c) * log2(e)
/// - offsets[j]); (M_j, Z_j) merges the first `used_tiles` of head j's tile partials (row `partials`: [group][tiles][2]).
/// Called by every thread of a block of kWarps warps; warp w takes heads w, w + kWarps, ...; the caller synchronises
/// before reading `offsets`.
template <int kWarps>
__device__ __forceinline__ void group_offsets(const float* partials, int group, int tiles, int used_tiles,
                                              float* offsets) {
  const int lane = threadIdx.x & 31;
  for (int g = static_cast<int>(threadIdx.x >> 5); g < group; g += kWarps) {
    float m = kNegativeInfinity;
    float s = 0.0F;
    const float2* partial = reinterpret_cast<const float2*>(partials + static_cast<long long>(g) * tiles * 2);
    // The lane's tiles t = lane, lane + 32, ... merged in that order, their loads kPartialBatch at a time ahead of the
    // merges (one round trip for up to 128 tiles, not one a tile: ~2 µs of the select's start at B = 1).
    constexpr int kPartialBatch = 4;
    for (int first = lane; first < used_tiles; first += 32 * kPartialBatch) {
      float2 batch[kPartialBatch];
#pragma unroll
      for (int j = 0; j < kPartialBatch; ++j) {
        const int t = first + 32 * j;
        batch[j] = t < used_tiles ? partial[t] : make_float2(kNegativeInfinity, 0.0F);
      }
#pragma unroll
      for (int j = 0; j < kPartialBatch; ++j) {
        if (first + 32 * j < used_tiles) merge_partial(m, s, batch[j].x, batch[j].y);
      }
    }
    warp_merge_partial(m, s);
    if (lane == 0) offsets[g] = m * kLog2e + log2f(s);
  }
}

/// The rule that folds one chunk's G logits into its score.
struct group_score_rule {
  bool probabilities;     ///< the rows hold summed probabilities (score_input::summed_probabilities)
  bool mean;              ///< dims::group_mean: the mean of the p_j(c); else their max
  int group;              ///< G
  const float* offsets;   ///< [G] (group_offsets); unused for probabilities
};

/// One chunk's score, folded head by head in head order: value = start_value(); candidate = is_candidate(x_0);
/// value = add_head(value, j, x_j) for j = 0..G-1; finish(value, candidate). score(c) = max_j p_j(c) =
/// exp2(max_j(x_j(c) * log2 e - offset_j)) (exp2 is monotonic: one exp a chunk), or the mean of the p_j(c) (an exp a
/// head); -1 for a non-candidate (an outlier or a local chunk: its first head's logit is -inf, or its probability -1).
/// Free functions of plain floats, so that a thread can fold several chunks with one register each.
__device__ __forceinline__ float start_value(const group_score_rule& rule) {
  return rule.mean || rule.probabilities ? 0.0F : kNegativeInfinity;
}

__device__ __forceinline__ bool is_candidate(const group_score_rule& rule, float first_head) {
  return rule.probabilities ? first_head >= 0.0F : first_head != kNegativeInfinity;
}

/// The running max of the heads' terms, or (mean) their running sum.
__device__ __forceinline__ float add_head(const group_score_rule& rule, float value, int g, float x) {
  if (rule.mean) return value + (rule.probabilities ? x : exp2f(fmaf(x, kLog2e, -rule.offsets[g])));
  return fmaxf(value, rule.probabilities ? x : fmaf(x, kLog2e, -rule.offsets[g]));
}

__device__ __forceinline__ float finish(const group_score_rule& rule, float value, bool candidate) {
  const float score = rule.mean ? value / static_cast<float>(rule.group) : (rule.probabilities ? value : exp2f(value));
  return candidate ? score : -1.0F;
}

}  // namespace shadowkv::cuda::selection
