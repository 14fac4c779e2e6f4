// Softmax partials (max, sum of exp(x - max)) and their merges, for the chunk selection's normalisers: per tile in
// the landmark logits kernel, per query head in the select kernel (group_scores.cuh).
#pragma once

#include <cuda_runtime.h>

#include "common/float_constants.cuh"

namespace shadowkv::cuda::selection {

/// Merges softmax partials (max, sum of exp(x - max)); (-inf, 0) is the empty partial.
__device__ __forceinline__ void merge_partial(float& m, float& s, float other_m, float other_s) {
  const float top = fmaxf(m, other_m);
  if (top == kNegativeInfinity) {
    m = top;
    s = 0.0F;
    return;
  }
  s = s * expf(m - top) + other_s * expf(other_m - top);
  m = top;
}

// Not cub::WarpReduce: its shuffle tree (offsets 1, 2, 4, ...) would round the float sums differently from this one.
__device__ __forceinline__ void warp_merge_partial(float& m, float& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_m = __shfl_xor_sync(0xffffffffU, m, offset);
    const float other_s = __shfl_xor_sync(0xffffffffU, s, offset);
    merge_partial(m, s, other_m, other_s);
  }
}

}  // namespace shadowkv::cuda::selection
